"""Qwen2.5-VL-3B's shape on one GPU, random bf16 weights: 100 prompts with one random image each at
concurrency 10, against vLLM's PR #23119 anchor (Qwen2.5-VL-3B-Instruct, `vllm bench serve --dataset-name
random-mm --num-prompts 100 --max-concurrency 10`: 5.61 req/s, 223 output tok/s, mean TTFT 1,536 ms; its
totals give 328 text tokens in and 40 out a request).

    requests  `jaxserve bench`'s own random-mm dataset (bench/datasets.build_requests with bench's flags):
              --random-input-len 320 text tokens in the chat template, 40 output tokens (ignore_eos), one
              image a request from vLLM's default buckets {(256, 256): 0.5, (720, 1280): 0.5}, JPEG data URLs
              decoded by the engine's media loader as `bench throughput` does (bench/random_mm.engine_prompts)
    driver    in process, no HTTP (the GPU image has no starlette/uvicorn): AsyncLLM, the server's own engine
              client (each image through the checkpoint's processor off the engine thread), 10 asyncio
              workers each sending its next request when the last one finished (bench serve's
              --max-concurrency 10, --request-rate inf); TTFT from the call to the first token
    model     transformers' Qwen2_5_VLConfig (LM: hidden 2048, 36 layers, 16 heads / 2 KV, intermediate 11008,
              vocab 151,936, tied; tower: depth 32, hidden 1280, out 2048, intermediate 3420, 16 heads,
              window 112, full attention in blocks 7/15/23/31) read by the engine (ModelConfig.from_hf); the
              weights in jaxserve's layout made on the device (scripts/gpu_random.py); the byte-level
              tokenizer with Qwen's special tokens and the real image processor (Qwen2VLImageProcessor, the
              checkpoint's min/max pixels) of tests/vl_fixtures.py, written to a temporary directory
    max_pixels --mm-processor-kwargs '{"max_pixels": 1003520}' by default (--max-pixels 0: the checkpoint's
              12,845,056): the tower's attention is dense over a program's patches, so the largest image
              bounds its memory (docs/vision.md)

    python scripts/gpu_vl.py                  # on the GPU
    python scripts/gpu_vl.py --cpu-smoke      # tiny shapes, Pallas in interpret mode, on a CPU
Prints a line per phase, one RESULT JSON line and a BRIEF line (scripts/gpu_check.sh collects them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

# Qwen/Qwen2.5-VL-3B-Instruct's config.json
TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
            num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6, tie_word_embeddings=True,
            hidden_act="silu", rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                                     mrope_section=[16, 24, 24]))
VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, window_size=112,
              fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", patch_size=14, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3, tokens_per_second=2)
MIN_PIXELS, MAX_PIXELS = 3136, 12845056  # its preprocessor_config.json
TINY_TEXT = dict(TEXT, vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
TINY_VISION = dict(VISION, depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                   window_size=56, fullatt_block_indexes=[1])
VLLM_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"  # vLLM's random-mm default (video dropped)
ANCHOR = dict(req_s=5.61, out_tok_s=223.37, mean_ttft_ms=1535.79)  # vLLM PR #23119, Qwen2.5-VL-3B-Instruct


def model_config(text: dict, vision: dict):
    """ModelConfig from transformers' Qwen2_5_VLConfig (its dict, as a config.json), the engine's reader."""
    from jaxserve.models.config import ModelConfig
    from tests.vl_fixtures import IDS, TOKEN_IDS

    text = dict(text, bos_token_id=IDS["<|endoftext|>"], eos_token_id=IDS["<|im_end|>"],
                pad_token_id=IDS["<|endoftext|>"])
    arch = ["Qwen2_5_VLForConditionalGeneration"]
    try:
        from transformers import Qwen2_5_VLConfig

        hf = Qwen2_5_VLConfig(text_config=text, vision_config=vision, architectures=arch, **TOKEN_IDS).to_dict()
    except (ImportError, TypeError):  # an older transformers: config.json's flat layout
        hf = dict(text, vision_config=vision, architectures=arch, **TOKEN_IDS)
    hf["tie_word_embeddings"] = text["tie_word_embeddings"]
    return ModelConfig.from_hf(hf, "Qwen2.5-VL-3B config.json")


def tower_shapes(vc) -> dict:
    """params["vision"]'s shapes (models/vision/qwen2_vl_vision.py's Params; Qwen2.5-VL's SwiGLU blocks)."""
    d, i, L, m = vc.hidden_size, vc.intermediate_size, vc.depth, vc.merge_unit * vc.hidden_size
    blocks = dict(norm1=(L, d), norm2=(L, d), qkv=(L, d, 3 * d), qkv_b=(L, 3 * d), proj=(L, d, d), proj_b=(L, d),
                  full=(L,), gate=(L, d, i), gate_b=(L, i), up=(L, d, i), up_b=(L, i), down=(L, i, d), down_b=(L, d))
    merger = dict(norm=(d,), fc1=(m, m), fc1_b=(m,), fc2=(m, vc.out_hidden_size), fc2_b=(vc.out_hidden_size,))
    return {"patch": (vc.patch_dim, d), "blocks": blocks, "merger": merger}


def write_processor(out: Path, max_pixels: int) -> None:
    """The tokenizer and the image processor a Qwen2.5-VL directory holds (no weights: those are made here)."""
    import transformers

    from tests.vl_fixtures import save_tokenizer

    save_tokenizer(out)
    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    cls(min_pixels=MIN_PIXELS, max_pixels=max_pixels).save_pretrained(out)


def random_model(args, out: Path):
    from transformers import AutoTokenizer

    from jaxserve.models import llama
    from jaxserve.plan.vision import vision_params
    from jaxserve.weights.loader import LoadedModel
    from scripts.gpu_random import num_params, random_params

    cfg = model_config(TINY_TEXT if args.cpu_smoke else TEXT, TINY_VISION if args.cpu_smoke else VISION)
    vc = cfg.vision
    shapes = {**llama.param_shapes(cfg), "vision": tower_shapes(vc)}
    tower = num_params(shapes["vision"]) - vc.depth  # less the `full` flags: no weights
    if tower != vision_params(vc):  # the plan's count is transformers' numel (tests/test_plan_vision.py)
        raise SystemExit(f"tower_shapes: {tower} params, transformers' tower has {vision_params(vc)}")
    full = np.asarray([float(i in vc.fullatt_block_indexes) for i in range(vc.depth)], np.float32)
    params = random_params(shapes, args.dtype, fixed={"vision/blocks/full": full},
                           is_bias=lambda name: name.endswith("_b") or name in ("bq", "bk", "bv"))
    write_processor(out, MAX_PIXELS if not args.cpu_smoke else 28 * 28 * 256)  # smoke: --max-pixels lowers it
    tok = AutoTokenizer.from_pretrained(str(out))
    return LoadedModel(cfg, params, tok, "random-qwen2.5-vl-3b", out), num_params(shapes) - vc.depth


def dataset(llm, args, num: int, seed: int) -> list:
    """bench's random-mm requests as `bench throughput` gives them to the engine (chat template, images)."""
    from jaxserve.bench import datasets as ds
    from jaxserve.bench.random_mm import engine_prompts
    from jaxserve.bench.throughput import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = p.parse_args(["--dataset-name", "random-mm", "--num-prompts", str(num), "--seed", str(seed),
                          "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                          "--random-mm-base-items-per-request", "1", "--random-mm-limit-mm-per-prompt",
                          '{"image": 1}', "--random-mm-bucket-config", args.buckets])
    reqs = ds.build_requests(flags, ds.HFTokenizer(llm.get_tokenizer()), as_ids=True)
    return list(zip(engine_prompts(llm, reqs), [r.expected_output_len for r in reqs]))


async def drive(engine, work: list, concurrency: int) -> dict:
    """bench serve's --max-concurrency loop against AsyncLLM: each worker sends its next request when the
    last one finished; per request TTFT (call -> first token), its latency and output tokens."""
    from jaxserve.core.sampling_params import SamplingParams

    todo = list(enumerate(work))
    rows: list[tuple[float, float, int, int]] = []

    async def worker() -> None:
        while todo:
            i, (prompt, max_tokens) = todo.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            t0, ttft, out = time.perf_counter(), None, None
            async for out in engine.generate(prompt, params, f"vl-{i}-{t0}"):
                if ttft is None and out.outputs and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
            rows.append((ttft or float("nan"), time.perf_counter() - t0, len(out.outputs[0].token_ids),
                         len(out.prompt_token_ids)))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    ttft, e2e, outs, ins = (np.asarray(c, np.float64) for c in zip(*rows))
    return dict(num_requests=len(rows), duration_s=elapsed, requests_per_second=len(rows) / elapsed,
                output_tokens_per_second=float(outs.sum()) / elapsed, total_input_tokens=int(ins.sum()),
                total_output_tokens=int(outs.sum()), mean_ttft_ms=float(np.nanmean(ttft)) * 1e3,
                median_ttft_ms=float(np.nanmedian(ttft)) * 1e3, p99_ttft_ms=float(np.nanpercentile(ttft, 99)) * 1e3,
                mean_tpot_ms=float(np.mean((e2e - ttft) / np.maximum(outs - 1, 1))) * 1e3)


def run(args) -> dict:
    import jax

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.llm import LLM

    tmp = Path(tempfile.mkdtemp(prefix="gpu_vl_"))
    t0 = time.perf_counter()
    model, count = random_model(args, tmp)
    init_s = time.perf_counter() - t0
    print(f"{count / 1e9:.3f} B params of random weights made in {init_s:.1f} s", flush=True)
    if args.cpu_smoke:  # the engine's backend hook: the Pallas kernels interpreted
        from jaxserve.engine import llm_engine
        from jaxserve.models.attention import PALLAS_INTERPRET

        llm_engine.resolve_backend = lambda name: PALLAS_INTERPRET
    kw = dict(dtype=args.dtype, attention_backend="pallas", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              compilation_cache_dir=args.compilation_cache_dir, block_size=16, kv_cache_dtype="auto",
              limit_mm_per_prompt={"image": 1})
    kw.update({"num_gpu_blocks_override": args.num_gpu_blocks} if args.num_gpu_blocks else
              {"gpu_memory_utilization": args.gpu_memory_utilization})
    if args.max_pixels:
        kw["mm_processor_kwargs"] = {"max_pixels": args.max_pixels}
    t0 = time.perf_counter()
    llm = LLM(model, progress=False, **kw)
    eng = llm.llm_engine
    ready_s = time.perf_counter() - t0
    print(f"engine ready in {ready_s:.1f} s (warm-up {eng.warmup_seconds:.1f} s), {eng.num_gpu_blocks} KV blocks, "
          f"tower buckets {getattr(eng.runner.mm, 'buckets', None)}", flush=True)
    warm, work = dataset(llm, args, args.concurrency, args.seed + 1), dataset(llm, args, args.num_prompts, args.seed)
    engine = AsyncLLM(eng)
    try:
        asyncio.run(drive(engine, warm, args.concurrency))  # other images (other seed): no encoder-cache hits
        print(f"{len(warm)} warm-up requests done", flush=True)
        res = asyncio.run(drive(engine, work, args.concurrency))
        compiles = eng.get_stats().num_compilations_after_warmup
    finally:
        engine.shutdown()
    res.update(model="qwen2.5-vl-3b" if not args.cpu_smoke else "tiny-qwen2.5-vl", dtype=args.dtype, params=count,
               device=jax.devices()[0].device_kind, jax=jax.__version__, init_weights_s=round(init_s, 1),
               engine_ready_s=round(ready_s, 1), num_gpu_blocks=eng.num_gpu_blocks, concurrency=args.concurrency,
               buckets=args.buckets, max_pixels=args.max_pixels or "the checkpoint's",
               num_compilations_after_warmup=compiles)
    return res


def brief(res: dict) -> str:
    a = ANCHOR
    return (f"{res['model']} {res['dtype']} pallas, {res['num_requests']} random-mm requests (1 image of "
            f"{res['buckets']}, max_pixels {res['max_pixels']}), concurrency {res['concurrency']}, AsyncLLM in "
            f"process (no HTTP): {res['requests_per_second']:.2f} req/s (vLLM {a['req_s']} on an H100), "
            f"{res['output_tokens_per_second']:.0f} output tok/s (vLLM {a['out_tok_s']:.0f}), mean TTFT "
            f"{res['mean_ttft_ms']:.0f} ms (vLLM {a['mean_ttft_ms']:.0f}), mean TPOT {res['mean_tpot_ms']:.1f} ms; "
            f"{res['total_input_tokens']} in / {res['total_output_tokens']} out tokens; engine ready "
            f"{res['engine_ready_s']} s, {res['num_compilations_after_warmup']} compiles after warm-up")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, float32, Pallas interpreted")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--input-len", type=int, default=320, help="random text tokens a prompt (vLLM's run: ~328)")
    p.add_argument("--output-len", type=int, default=40)
    p.add_argument("--buckets", default=VLLM_BUCKETS, help="--random-mm-bucket-config")
    p.add_argument("--max-pixels", type=int, default=1003520,
                   help="mm_processor_kwargs max_pixels; 0: the checkpoint's")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--num-gpu-blocks", type=int, default=0)
    p.add_argument("--compilation-cache-dir", default="")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.cpu_smoke:
        args.dtype, args.num_prompts, args.concurrency, args.input_len, args.output_len = "float32", 6, 2, 24, 4
        args.buckets, args.max_pixels = "{(56, 56, 1): 0.5, (84, 112, 1): 0.5}", 28 * 28 * 64
        args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len, args.num_gpu_blocks = 4, 64, 256, 64
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    res = run(args)
    print("RESULT " + json.dumps(res), flush=True)
    print("BRIEF " + brief(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
