"""The Pallas MLA decode kernel (pallas_kernels/mla_decode.py) on a GPU: correctness against the XLA path,
then its bandwidth at batch 128, 4k context against the bytes it must read (needs jax + numpy only).

The bytes of a decode step are the latent pool's live entries, read once: batch x context x 576 x 2
(bfloat16), plus q and the output (small). FlashMLA's figure: 2,826 GB/s on an H100 (bf16, 64-token
blocks, batch 128, 4k context, 128 heads; its README, H800 3,000). Shapes: DeepSeek-V2-Lite's 16 heads
and V3's 128 (one GPU, no TP), kv_lora_rank 512 + rope 64, 64-token blocks (FlashMLA's) and 16 (the
engine's default); the XLA path (mla_decode_reference) timed at the same shapes.

    python scripts/gpu_mla.py              # on the GPU
    python scripts/gpu_mla.py --cpu-smoke  # interpret mode, tiny shapes, on a CPU
Prints one BRIEF line per measurement (scripts/gpu_check.sh collects them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.mla_decode import launch_shape, mla_decode, mla_decode_reference  # noqa: E402


def timeit(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def inputs(batch: int, ctx: int | list[int], heads: int, rank: int, rope: int, bs: int, dtype, seed: int = 0):
    """q [B, H, rank + rope], a pool [1, NB, bs, rank + rope] of random entries, kv_lens, block tables
    (each sequence's blocks at random places; 0 is never used, as the engine's null block)."""
    lens = np.full(batch, ctx, np.int32) if isinstance(ctx, int) else np.asarray(ctx, np.int32)
    blocks = int(-(-lens.max() // bs))
    rng = np.random.default_rng(seed)
    pool = jax.random.normal(jax.random.key(seed), (1, batch * blocks + 1, bs, rank + rope), jnp.float32)
    q = jax.random.normal(jax.random.key(seed + 1), (batch, heads, rank + rope), jnp.float32)
    tables = jnp.asarray(1 + rng.permutation(batch * blocks).reshape(batch, blocks), jnp.int32)
    return q.astype(dtype), pool.astype(dtype), jnp.asarray(lens), tables


def correctness(interpret: bool) -> bool:
    ok = True
    rank, rope = (64, 16) if interpret else (512, 64)
    cases = [(16, 16, "float32"), (20, 64, "bfloat16")] if interpret else \
        [(16, 16, "float32"), (16, 64, "bfloat16"), (128, 64, "bfloat16"), (20, 16, "float32")]
    lens = [1, 15, 16, 17, 64, 200, 3, 129]
    for heads, bs, dt in cases:
        dtype = jnp.dtype(dt)
        args = inputs(len(lens), lens, heads, rank, rope, bs, dtype, seed=heads + bs)
        kw = dict(kv_lora_rank=rank, sm_scale=0.07)
        want = np.asarray(mla_decode_reference(*(a.astype(jnp.float32) if a.dtype == dtype else a for a in args),
                                               **kw))
        got = np.asarray(jax.jit(lambda *a: mla_decode(*a, interpret=interpret, **kw))(*args), np.float32)
        err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))
        tol = (1e-5 if interpret else 1e-4) if dt == "float32" else 2e-2
        good = err < tol and bool(np.all(np.isfinite(got)))
        print(f"BRIEF mla_decode check heads={heads} bs={bs} {dt}: rel_err {err:.1e} {'PASS' if good else 'FAIL'}")
        ok &= good
    return ok


def benchmarks(interpret: bool) -> None:
    if interpret:
        batch, ctx, rank, rope, reps, grid = 4, 64, 64, 16, 1, [(16, 16)]
    else:
        batch, ctx, rank, rope, reps, grid = 128, 4096, 512, 64, 20, [(16, 64), (128, 64), (16, 16), (128, 16)]
    x = jnp.ones((1 << (22 if interpret else 30)) // 2, jnp.bfloat16)
    copy = 2 * x.nbytes / timeit(jax.jit(lambda x: x + 1), x, reps=reps) / 1e9
    print(f"device: {jax.devices()[0].device_kind}, copy bandwidth {copy:.0f} GB/s")
    for heads, bs in grid:
        q, pool, lens, tables = inputs(batch, ctx, heads, rank, rope, bs, jnp.bfloat16)
        need = batch * ctx * (rank + rope) * 2 + q.nbytes + batch * heads * rank * 2
        kw = dict(kv_lora_rank=rank, sm_scale=0.07)
        kern = timeit(jax.jit(lambda *a: mla_decode(*a, interpret=interpret, **kw)), q, pool, lens, tables, reps=reps)
        ref = timeit(jax.jit(lambda *a: mla_decode_reference(*a, **kw)), q, pool, lens, tables, reps=max(1, reps // 4))
        hb, groups, splits, warps = launch_shape(batch, heads, tables.shape[1] * bs)
        print(f"BRIEF mla_decode b={batch} ctx={ctx} heads={heads} bs={bs}: {kern * 1e3:.3f} ms, "
              f"{need / kern / 1e9:.0f} GB/s ({100 * need / kern / 1e9 / copy:.0f}% of copy; FlashMLA 2826 on H100); "
              f"XLA path {ref * 1e3:.3f} ms ({ref / kern:.1f}x); grid {batch}x{groups}x{splits}, {hb} heads, {warps} warps")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="interpret mode, tiny shapes (default without a GPU)")
    args = parser.parse_args()
    interpret = args.cpu_smoke or not any(d.platform == "gpu" for d in jax.devices())
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {'interpret' if interpret else 'Triton'}")
    ok = correctness(interpret)
    benchmarks(interpret)
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
