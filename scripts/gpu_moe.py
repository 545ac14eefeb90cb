"""Qwen3-30B-A3B's shape on one GPU: engine output tok/s at 8 and 64 concurrent sequences, and the
expert computation's grouped matmul (Pallas Triton) against jax.lax.ragged_dot and the XLA
blocked path at decode sizes.

Shape (config.json of Qwen/Qwen3-30B-A3B): 48 layers, 128 experts, top-8 (norm_topk_prob),
hidden 2048, moe_intermediate 768, 32 query / 4 KV heads of 128, vocab 151,936; bfloat16 random
weights, made on the device (61 GB: never via the host), as scripts/gpu_engine.py does for the
dense shapes. Random weights route roughly uniformly: the real model's skew is not modelled.
Prompts: random ids of --input-len tokens, --output-len greedy tokens each (ignore_eos), all at t=0.

Anchor (issue 38): vLLM on one H100 serves Qwen3-30B-A3B at about 611 tok/s with 8 sequences and
2,164 with 64 (ML.ENERGY leaderboard); the target is 1.2x those on an H200.

    python scripts/gpu_moe.py                    # on the GPU
    python scripts/gpu_moe.py --cpu-smoke        # a tiny shape, Pallas in interpret mode, on a CPU
Prints one BRIEF line per measurement (scripts/gpu_check.sh collects them) and a RESULT JSON line.
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

SHAPES = {
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                          num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
                 moe=dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)),
}


def config(name: str):
    from jaxserve.models.config import ModelConfig, MoeConfig

    shape = dict(SHAPES[name])
    moe = MoeConfig(norm_topk_prob=True, **shape.pop("moe"))
    return ModelConfig(architecture="Qwen3MoeForCausalLM", qk_norm=True, max_position_embeddings=4096,
                       tie_word_embeddings=False, moe=moe, **shape)


def random_model(name: str, dtype: str):
    """Weights of `name`'s shape made on the device leaf by leaf, by an elementwise hash of each
    element's index (one fused loop: a 19 GB expert leaf needs no float32 or random-bits buffer)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import llama
    from jaxserve.models.expert_weights import EXPERT_STACKS
    from jaxserve.weights.loader import LoadedModel
    from scripts.gpu_random import hash_uniform

    cfg = config(name)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(llama.param_shapes(cfg),
                                                           is_leaf=lambda x: isinstance(x, tuple))
    dt = jnp.dtype(dtype)

    def make(seed, shape, is_norm, fan_in):
        u = hash_uniform(seed, shape)  # scripts/gpu_random.py
        if is_norm:
            return (1.0 + 0.1 * u).astype(dt)
        return (u * (2.6 / np.sqrt(fan_in))).astype(dt)  # std of U(-a, a) is a / sqrt(3)

    out = []
    for i, (path, shape) in enumerate(leaves):
        leaf = str(path[-1].key)
        # dense leaves are [L, in, out]; the expert stacks [L, E, out, in]
        fan_in = 64 if len(shape) < 2 or leaf == "embed" else shape[-1] if leaf in EXPERT_STACKS else shape[-2]
        out.append(jax.jit(make, static_argnums=(0, 1, 2, 3))(i + 1, tuple(shape), "norm" in leaf, fan_in))
    params = jax.tree.unflatten(treedef, out)
    jax.block_until_ready(params)
    return LoadedModel(cfg, params, None, f"random-{name}", Path("."))


def engine_tok_s(args, model, num_seqs: int) -> dict:
    from jaxserve import LLM, SamplingParams

    kw = dict(dtype=args.dtype, max_num_seqs=num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.input_len + args.output_len + 16, attention_backend=args.attention_backend,
              enable_prefix_caching=False, compilation_cache_dir=args.compilation_cache_dir)
    if args.num_gpu_blocks:
        kw["num_gpu_blocks_override"] = args.num_gpu_blocks
    else:
        kw["gpu_memory_utilization"] = 0.9
    t0 = time.perf_counter()
    llm = LLM(model, progress=False, **kw)
    ready = time.perf_counter() - t0
    rng = np.random.default_rng(num_seqs)
    prompts = [{"prompt_token_ids": rng.integers(0, model.config.vocab_size, args.input_len).tolist()}
               for _ in range(num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = dict(num_seqs=num_seqs, output_tokens=num_out, seconds=round(elapsed, 3),
               output_tok_s=round(num_out / elapsed, 1), engine_ready_s=round(ready, 1),
               compilations_after_warmup=llm.llm_engine.get_stats().num_compilations_after_warmup)
    llm.llm_engine.shutdown()
    return res


def kernel_times(args) -> list[dict]:
    """One grouped matmul of the expert computation (gate: K = hidden, N = I; down: K = I, N =
    hidden) at decode sizes, rows sorted by expert with uniform random routing: the Pallas kernel,
    jax.lax.ragged_dot (over its own [E, K, N] copy of the weights) and the XLA blocked path."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models.attention import PALLAS_INTERPRET
    from jaxserve.models.expert_weights import grouped_matmul

    cfg = config(args.model)
    e, k, h, i = cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.hidden_size, cfg.moe.moe_intermediate_size
    backend = PALLAS_INTERPRET if args.cpu_smoke else "pallas"
    rng = np.random.default_rng(0)
    out = []
    for num_tokens in args.kernel_tokens:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(num_tokens)]).reshape(-1)
        sizes = jnp.asarray(np.bincount(ids, minlength=e), jnp.int32)
        m = num_tokens * k
        for kdim, ndim, what in ((h, i, "gate"), (i, h, "down")):
            lhs = jnp.asarray(rng.standard_normal((m, kdim)), args.dtype)
            rhs = jnp.asarray(rng.standard_normal((e, ndim, kdim)) / np.sqrt(kdim), args.dtype)  # [E, N, K]
            rhs_kn = jnp.swapaxes(rhs, 1, 2).copy()  # ragged_dot takes [E, K, N]
            fns = {"pallas": jax.jit(lambda a, b, s: grouped_matmul(a, b, s, backend)),
                   "ragged_dot": jax.jit(jax.lax.ragged_dot),
                   "xla_blocked": jax.jit(lambda a, b, s: grouped_matmul(a, b, s, "xla"))}
            row = dict(tokens=num_tokens, rows=m, matmul=what, k=kdim, n=ndim,
                       bytes_touched=int((np.asarray(sizes) > 0).sum()) * kdim * ndim * np.dtype(args.dtype).itemsize)
            ref = None
            for name, fn in fns.items():
                operands = (lhs, rhs_kn if name == "ragged_dot" else rhs, sizes)
                y = jax.block_until_ready(fn(*operands))
                ref = y if ref is None else ref
                err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))
                t = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*operands))
                    t.append(time.perf_counter() - t0)
                row[name + "_us"] = round(float(np.median(t)) * 1e6, 1)
                row[name + "_maxdiff"] = err
            row["pallas_gb_s"] = round(row["bytes_touched"] / row["pallas_us"] / 1e3, 1)
            out.append(row)
            print(f"BRIEF kernel {what} T={num_tokens} (M={m}, K={kdim}, N={ndim}): pallas {row['pallas_us']} us "
                  f"({row['pallas_gb_s']} GB/s of touched experts), ragged_dot {row['ragged_dot_us']} us, "
                  f"xla blocked {row['xla_blocked_us']} us; max diff vs pallas {row['ragged_dot_maxdiff']:.3g}",
                  flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape, Pallas in interpret mode, float32")
    p.add_argument("--model", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-seqs", type=int, nargs="+", default=[8, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)  # a small bucket grid: warm-up compiles
    p.add_argument("--num-gpu-blocks", type=int, default=0)
    p.add_argument("--attention-backend", default="pallas")
    p.add_argument("--compilation-cache-dir", default="")
    p.add_argument("--kernel-tokens", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()
    if args.cpu_smoke:
        args.model, args.dtype, args.input_len, args.output_len = "tiny", "float32", 16, 8
        args.max_num_batched_tokens, args.num_gpu_blocks, args.repeats = 64, 128, 2
        args.kernel_tokens = [1, 8]
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.model} in {args.dtype}", flush=True)
    result: dict = dict(model=args.model, dtype=args.dtype, device=jax.devices()[0].device_kind, engine=[])
    result["kernels"] = kernel_times(args)
    if not args.skip_engine:
        if args.cpu_smoke:  # the engine's backend hook: Pallas kernels in interpret mode on the CPU
            from jaxserve.engine import llm_engine
            from jaxserve.models.attention import PALLAS_INTERPRET

            llm_engine.resolve_backend = lambda name: PALLAS_INTERPRET
        t0 = time.perf_counter()
        model = random_model(args.model, args.dtype)
        print(f"random weights in {time.perf_counter() - t0:.1f} s", flush=True)
        for n in args.num_seqs:
            res = engine_tok_s(args, model, n)
            result["engine"].append(res)
            print(f"BRIEF {args.model} {args.dtype} {n} seqs: {res['output_tok_s']} output tok/s "
                  f"({res['output_tokens']} tokens in {res['seconds']} s; engine ready in {res['engine_ready_s']} s, "
                  f"{res['compilations_after_warmup']} compiles after warm-up)", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
