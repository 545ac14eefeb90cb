"""Correctness sweep + bandwidth/FLOP benchmarks for pallas_kernels (needs jax + numpy only).

On a GPU: kernels compiled through Triton, benchmarked at Llama-3.1-8B shapes
(32 q heads, 8 kv heads, head_dim 128, block_size 16; batch 64/256; contexts
1k/4k). Without a GPU (or with --cpu-smoke): interpret mode, tiny shapes, to
prove the script runs end to end.
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

from pallas_kernels import (  # noqa: E402
    paged_attention_decode,
    ragged_paged_attention,
    write_kv,
    write_kv_reference,
)
from pallas_kernels.testing import make_batch, numpy_attention, poison  # noqa: E402

SWEEP = [  # (seqs, block_size, head_dim, group, num_kv_heads, dtype, window, cap)
    ([(1, 5), (1, 17), (1, 1), (1, 32)], 8, 64, 1, 2, "float32", None, None),
    ([(7, 7), (16, 16), (1, 1)], 16, 128, 3, 1, "float32", None, None),
    ([(1, 9), (12, 12), (1, 33), (5, 5)], 32, 64, 8, 1, "bfloat16", None, None),
    ([(6, 20), (1, 8), (16, 40)], 16, 128, 8, 2, "float32", 7, None),
    ([(8, 16), (16, 32), (1, 16), (32, 32)], 16, 64, 3, 2, "bfloat16", None, 5.0),
    ([(1, 300), (40, 700), (1, 1000)], 16, 128, 4, 8, "bfloat16", None, None),
]


def timeit(fn, *args, reps: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-6))


def correctness(interpret: bool) -> bool:
    ok = True
    sweep = SWEEP[:3] if interpret else SWEEP
    for i, (seqs, bs, d, g, hkv, dt, win, cap) in enumerate(sweep):
        dtype = jnp.float32 if dt == "float32" else jnp.bfloat16
        b = make_batch(np.random.default_rng(i), seqs, num_kv_heads=hkv, group=g, head_dim=d,
                       block_size=bs, max_num_seqs=len(seqs) + 2, pad_tokens=3,
                       dtype=np.float32 if dt == "float32" else jnp.bfloat16)
        b.k_cache, b.v_cache = poison(b.k_cache, b.owned, np.nan), poison(b.v_cache, b.owned, np.nan)
        kw = dict(sm_scale=d**-0.5, sliding_window=win, soft_cap=cap)
        want = numpy_attention(b, **kw)
        tol = 1e-5 if dt == "float32" else 2e-2
        if not interpret:
            tol *= 10  # TF32-free IEEE dots, but GPU exp/tanh differ from numpy in the last ulps
        args = (jnp.asarray(b.q, dtype), jnp.asarray(b.k_cache, dtype),
                jnp.asarray(b.v_cache, dtype), jnp.asarray(b.kv_lens),
                jnp.asarray(b.block_tables))
        out = ragged_paged_attention(*args, jnp.asarray(b.cu_q_lens), jnp.int32(b.num_seqs),
                                     interpret=interpret, **kw)
        err = rel_err(out, want)
        good = err < tol and bool(np.all(np.isfinite(np.asarray(out, np.float32))))
        print(f"ragged  case {i}: bs={bs} d={d} group={g} {dt} window={win} cap={cap} "
              f"rel_err={err:.2e} {'PASS' if good else 'FAIL'}")
        ok &= good
        if all(q == 1 for q, _ in seqs):
            n = len(seqs)
            dq = jnp.asarray(b.q[:n], dtype)
            out = paged_attention_decode(dq, *args[1:3], jnp.asarray(b.kv_lens[:n]),
                                         jnp.asarray(b.block_tables[:n]), interpret=interpret,
                                         **kw)
            err = rel_err(out, want[:n])
            good = err < tol
            print(f"decode  case {i}: rel_err={err:.2e} {'PASS' if good else 'FAIL'}")
            ok &= good
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((2, 8, 16, 64)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((9, 2, 64)), jnp.float32)
    slots = jnp.asarray(np.r_[rng.permutation(128)[:7], -1, -1], jnp.int32)
    got = write_kv(k, k, new, new, slots, interpret=interpret)
    want_kv = write_kv_reference(k, k, new, new, slots)
    good = all(np.array_equal(np.asarray(a), np.asarray(w)) for a, w in zip(got, want_kv))
    print(f"write_kv: {'PASS' if good else 'FAIL'}")
    return ok and good


def copy_bandwidth(num_bytes: int, reps: int) -> float:
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)  # reads and writes num_bytes each
    return 2 * num_bytes / timeit(f, x, reps=reps) / 1e9


def paged_inputs(batch, ctx, q_len, hq, hkv, d, bs):
    blocks = -(-ctx // bs)
    rng = np.random.default_rng(0)
    shape = (hkv, batch * blocks + 1, bs, d)
    k = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(batch * blocks).reshape(batch, blocks), jnp.int32)
    q = jax.random.normal(jax.random.key(2), (batch * q_len, hq, d), jnp.bfloat16)
    kv_lens = jnp.full((batch,), ctx, jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * q_len
    return q, k, v, kv_lens, tables, cu


def benchmarks(interpret: bool) -> None:
    if interpret:
        hq, hkv, d, bs, reps = 8, 2, 64, 16, 1
        grid, prefill = [(4, 64)], [(2, 32)]
        copy_bytes = 1 << 22
    else:
        hq, hkv, d, bs, reps = 32, 8, 128, 16, 20
        grid, prefill = [(64, 1024), (64, 4096), (256, 1024), (256, 4096)], [(4, 1024), (2, 4096)]
        copy_bytes = 1 << 30
    copy = copy_bandwidth(copy_bytes, reps)
    print(f"\ndevice: {jax.devices()[0].device_kind}  measured copy bandwidth: {copy:.1f} GB/s")
    print(f"shapes: q_heads={hq} kv_heads={hkv} head_dim={d} block_size={bs} bfloat16")
    print(f"{'kernel':<22}{'batch':>6}{'context':>9}{'ms':>10}{'GB/s':>10}{'% copy':>8}"
          f"{'TFLOP/s':>9}")
    scale = d**-0.5
    for batch, ctx in grid:
        q, k, v, kv_lens, tables, cu = paged_inputs(batch, ctx, 1, hq, hkv, d, bs)
        kv_bytes = 2 * batch * ctx * hkv * d * 2
        dec = jax.jit(lambda *a: paged_attention_decode(*a, sm_scale=scale, interpret=interpret))
        t = timeit(dec, q, k, v, kv_lens, tables, reps=reps)
        print(f"{'decode':<22}{batch:>6}{ctx:>9}{t * 1e3:>10.3f}{kv_bytes / t / 1e9:>10.1f}"
              f"{100 * kv_bytes / t / 1e9 / copy:>7.1f}%{'':>9}")
        rag = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, interpret=interpret))
        t = timeit(rag, q, k, v, kv_lens, tables, cu, jnp.int32(batch), reps=reps)
        print(f"{'ragged (decode batch)':<22}{batch:>6}{ctx:>9}{t * 1e3:>10.3f}"
              f"{kv_bytes / t / 1e9:>10.1f}{100 * kv_bytes / t / 1e9 / copy:>7.1f}%{'':>9}")
    for batch, ctx in prefill:
        q, k, v, kv_lens, tables, cu = paged_inputs(batch, ctx, ctx, hq, hkv, d, bs)
        flops = 4 * batch * hq * d * ctx * (ctx + 1) / 2  # causal QK^T + PV
        rag = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, interpret=interpret))
        t = timeit(rag, q, k, v, kv_lens, tables, cu, jnp.int32(batch), reps=max(1, reps // 4))
        print(f"{'ragged (prefill)':<22}{batch:>6}{ctx:>9}{t * 1e3:>10.3f}{'':>10}{'':>8}"
              f"{flops / t / 1e12:>9.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="interpret mode, tiny shapes (default when no GPU is present)")
    parser.add_argument("--skip-sweep", action="store_true", help="benchmarks only (the sweep passed on an H200)")
    args = parser.parse_args()
    has_gpu = any(dev.platform == "gpu" for dev in jax.devices())
    interpret = args.cpu_smoke or not has_gpu
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{'interpret mode (CPU smoke)' if interpret else 'compiled (Triton)'}")
    ok = True if args.skip_sweep else correctness(interpret)
    benchmarks(interpret)
    print("\nALL PASS" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
