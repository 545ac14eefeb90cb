"""DeepSeek-V2-Lite's shape on one GPU, random bf16 weights: the engine's offline throughput at vLLM's
PR #10927 workload (every request 1,000 prompt tokens and 100 output tokens, greedy, ignore_eos, all at
t=0), with its anchor beside it: vLLM 18.5 req/s on an H100 once it stored the latent and decoded with
absorbed weights (10.5 before).

Shape: DeepSeek-V2-Lite's published config.json, read through transformers' DeepseekV2Config and the
engine's own config reader (ModelConfig.from_hf): hidden 2048, 27 layers, 16 heads, kv_lora_rank 512,
qk_nope 128 / qk_rope 64, v_head_dim 128, no q_lora_rank, 64 routed experts top-6 (greedy softmax),
2 shared, moe_intermediate 1408, layer 0 dense (intermediate 10944), vocab 102,400, YaRN x40 (15.7 B
params, 31 GB in bf16). Weights in jaxserve's param layout (llama.param_shapes -> the DeepSeek family's
tree), made on the device (scripts/gpu_random.py). Random weights route roughly uniformly: the real
model's expert skew is not modelled. The Pallas backend: the MLA decode kernel on decode-only steps,
the grouped-matmul experts; prefill runs the XLA path (expanded or absorbed, models/mla_prefill.py).

    python scripts/gpu_deepseek.py                  # on the GPU (200 requests)
    python scripts/gpu_deepseek.py --cpu-smoke      # a tiny shape, Pallas in interpret mode, on a CPU
Prints a line per phase, one RESULT JSON line and a BRIEF line (scripts/gpu_check.sh collects them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), the fields a config reader uses
V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], attention_bias=False, bos_token_id=100000, eos_token_id=100001,
    first_k_dense_replace=1, hidden_act="silu", hidden_size=2048, intermediate_size=10944, kv_lora_rank=512,
    max_position_embeddings=163840, moe_intermediate_size=1408, moe_layer_freq=1, n_group=1, n_routed_experts=64,
    n_shared_experts=2, norm_topk_prob=False, num_attention_heads=16, num_experts_per_tok=6, num_hidden_layers=27,
    num_key_value_heads=16, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-6,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                      original_max_position_embeddings=4096, type="yarn"),
    rope_theta=10000, routed_scaling_factor=1.0, scoring_func="softmax", tie_word_embeddings=False, topk_group=1,
    topk_method="greedy", v_head_dim=128, vocab_size=102400)
# the same structure in small (a dense layer 0, shared experts, no q_lora_rank, YaRN) for the CPU smoke
TINY = dict(V2_LITE, hidden_size=64, intermediate_size=128, kv_lora_rank=32, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4,
            num_hidden_layers=3, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512,
            bos_token_id=0, eos_token_id=1)
ANCHOR_REQ_S = 18.5  # vLLM, PR #10927, DeepSeek-V2-Lite on one H100, 1000 in / 100 out


def model_config(shape: dict):
    """ModelConfig from transformers' config object (its dict, as a config.json), the engine's reader."""
    from jaxserve.models.config import ModelConfig

    try:
        from transformers import DeepseekV2Config

        hf = DeepseekV2Config(**shape).to_dict()
    except ImportError:  # a transformers without DeepSeek V2: the config.json fields as they are
        hf = dict(shape)
    hf["architectures"] = shape["architectures"]
    return ModelConfig.from_hf(hf, "DeepSeek-V2-Lite config.json")


def random_model(shape: dict, dtype: str):
    from jaxserve.models import llama
    from jaxserve.weights.loader import LoadedModel
    from scripts.gpu_random import num_params, random_params

    cfg = model_config(shape)
    shapes = llama.param_shapes(cfg)
    sparse = np.asarray([float(cfg.moe.is_sparse(i)) for i in range(cfg.num_layers)], np.float32)
    params = random_params(shapes, dtype, fixed={"layers/sparse": sparse})
    return LoadedModel(cfg, params, None, "random-deepseek-v2-lite", Path(".")), num_params(shapes)


def engine_kwargs(args) -> dict:
    from jaxserve.engine import llm_engine
    from jaxserve.models.attention import PALLAS_INTERPRET

    if args.cpu_smoke:  # the engine's backend hook: the Pallas kernels (MLA decode, experts) interpreted
        llm_engine.resolve_backend = lambda name: PALLAS_INTERPRET
    kw = dict(dtype=args.dtype, attention_backend="pallas", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.input_len + args.output_len + 16, enable_chunked_prefill=True,
              enable_prefix_caching=False, compilation_cache_dir=args.compilation_cache_dir, block_size=16,
              kv_cache_dtype="auto")
    if args.num_gpu_blocks:
        kw["num_gpu_blocks_override"] = args.num_gpu_blocks
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kw


def requests(num: int, vocab: int, input_len: int, output_len: int, seed: int):
    from jaxserve.bench.datasets import SampleRequest

    rng = np.random.default_rng(seed)
    return [SampleRequest(rng.integers(0, vocab, input_len).tolist(), input_len, output_len) for _ in range(num)]


def run(args) -> dict:
    import jax

    from jaxserve.bench.throughput import run_throughput
    from jaxserve.entrypoints.llm import LLM

    t0 = time.perf_counter()
    model, count = random_model(TINY if args.cpu_smoke else V2_LITE, args.dtype)
    init_s = time.perf_counter() - t0
    print(f"{count / 1e9:.2f} B params of random weights made in {init_s:.1f} s", flush=True)
    t0 = time.perf_counter()
    llm = LLM(model, progress=False, **engine_kwargs(args))
    eng = llm.llm_engine
    ready_s = time.perf_counter() - t0
    print(f"engine ready in {ready_s:.1f} s (warm-up {eng.warmup_seconds:.1f} s), {eng.num_gpu_blocks} KV blocks",
          flush=True)
    vocab = model.config.vocab_size
    run_throughput(llm, requests(4, vocab, args.input_len, 8, args.seed + 1), progress=False)  # off the clock
    print("first 4 requests done", flush=True)
    res = run_throughput(llm, requests(args.num_prompts, vocab, args.input_len, args.output_len, args.seed),
                         progress=False)
    res.update(model="deepseek-v2-lite" if not args.cpu_smoke else "tiny-deepseek-v2", dtype=args.dtype,
               params=count, device=jax.devices()[0].device_kind, jax=jax.__version__, init_weights_s=round(init_s, 1),
               engine_ready_s=round(ready_s, 1), warmup_s=round(eng.warmup_seconds, 1),
               num_gpu_blocks=eng.num_gpu_blocks, input_len=args.input_len, output_len=args.output_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               num_compilations_after_warmup=eng.get_stats().num_compilations_after_warmup)
    eng.shutdown()
    return res


def brief(res: dict) -> str:
    return (f"{res['model']} {res['dtype']} pallas, {res['num_requests']} requests of {res['input_len']} in / "
            f"{res['output_len']} out (vLLM PR #10927's workload): {res['requests_per_second']:.2f} req/s "
            f"(vLLM {ANCHOR_REQ_S} on an H100), {res['output_tokens_per_second']:.0f} output tok/s, "
            f"{res['tokens_per_second']:.0f} total tok/s, mean TTFT {res['mean_ttft_ms']:.0f} ms (all at t=0); "
            f"engine ready {res['engine_ready_s']} s, {res['num_gpu_blocks']} KV blocks, "
            f"{res['num_compilations_after_warmup']} compiles after warm-up")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape, float32, Pallas interpreted")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=200, help="vLLM's run: 1,000 (a device-time budget here)")
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks", type=int, default=0)
    p.add_argument("--compilation-cache-dir", default="")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.cpu_smoke:
        args.dtype, args.num_prompts, args.input_len, args.output_len = "float32", 6, 40, 6
        args.max_num_seqs, args.max_num_batched_tokens, args.num_gpu_blocks = 8, 64, 128
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    res = run(args)
    print("RESULT " + json.dumps(res), flush=True)
    print("BRIEF " + brief(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
