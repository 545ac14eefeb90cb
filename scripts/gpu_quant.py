"""Quantized matmuls on a GPU at Llama-3.1-8B's layer shapes: the Pallas W4A16 kernel and the fp8 dot
against a bfloat16 jnp.dot.

One "layer" is the seven projections of a Llama-3.1-8B decoder layer (K x N: q, o 4096x4096; k, v
4096x1024; gate, up 4096x14336; down 14336x4096), jitted as one program per method and batch size.
Random weights (timing depends on shapes only); the W4A16 weights use group size 128. Each timing
is the median of --iters runs after a warm-up. Prints one line per batch size M and a SUMMARY line.

  python scripts/gpu_quant.py            # on the H200 (< 60 s)
  python scripts/gpu_quant.py --cpu-smollm2  # CPU: SmolLM2-135M's layer in float32, XLA paths vs float32
  python scripts/gpu_quant.py --cpu-smoke  # tiny shapes, to check the script runs anywhere (on a CPU
                                           # "kernel" is the XLA dequantize-then-dot path)
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

from jaxserve.quantization import QuantizedWeight, matmul  # noqa: E402
from pallas_kernels.w4a16_matmul import w4a16_matmul_reference  # noqa: E402

SMOLLM2 = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
LAYER = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
GROUP = 128


def weights(shapes, rng, dtype=jnp.bfloat16, group: int = GROUP):
    bf16, w4, f8 = [], [], []
    for k, n in shapes:
        key = jax.random.fold_in(rng, k * 7 + n)
        bf16.append(jax.random.normal(key, (k, n), dtype) * 0.02)
        packed = jax.random.randint(key, (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
        scales = jnp.full((k // group, n), 0.002, dtype)
        zeros = jnp.full((k // group, n), 8, jnp.uint8)
        w4.append(QuantizedWeight(packed, scales, zeros, scheme="w4a16", group_size=group))
        f8.append(QuantizedWeight(jax.random.normal(key, (k, n), jnp.float32).astype(jnp.float8_e4m3fn),
                                  jnp.full((1, n), 0.02, jnp.float32), scheme="fp8"))
    return bf16, w4, f8


def run_layer(x, x_down, ws):
    return [matmul(x_down if w.shape[0] != x.shape[1] else x, w) for w in ws]


def run_layer_bf16(x, x_down, ws):
    return [jnp.dot(x_down if w.shape[0] != x.shape[1] else x, w) for w in ws]


def median_seconds(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes (any machine)")
    ap.add_argument("--cpu-smollm2", action="store_true", help="SmolLM2-135M's layer, float32, vs float32")
    args = ap.parse_args()
    if args.cpu_smollm2:
        return cpu_smollm2(args.iters)
    shapes = [(256, 128), (256, 512), (512, 256)] if args.cpu_smoke else LAYER
    t_start = time.perf_counter()
    print(f"devices: {jax.devices()}  jax {jax.__version__}")
    bf16, w4, f8 = weights(shapes, jax.random.PRNGKey(0))
    k_in, k_down = shapes[0][0], shapes[-1][0]
    f_w4 = jax.jit(run_layer)
    f_bf = jax.jit(run_layer_bf16)
    # Correctness once: the kernel path against the pure-jnp reference at M = 16.
    x = jax.random.normal(jax.random.PRNGKey(1), (16, k_in), jnp.bfloat16)
    got = matmul(x, w4[0]).astype(jnp.float32)
    want = w4a16_matmul_reference(x, w4[0].values, w4[0].scales, w4[0].zeros, group_size=GROUP).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    print(f"w4a16 kernel vs reference at M=16: max error {err:.2e} of the output range")
    ratios = {}
    for m in (1, 16, 64):
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k_in), jnp.bfloat16)
        xd = jax.random.normal(jax.random.PRNGKey(m + 1), (m, k_down), jnp.bfloat16)
        t_q = median_seconds(f_w4, (x, xd, w4), args.iters)
        t_b = median_seconds(f_bf, (x, xd, bf16), args.iters)
        ratios[f"w4a16 M={m}"] = t_b / t_q
        print(f"w4a16 M={m:3d}: kernel {t_q * 1e6:8.1f} us  bf16 jnp.dot {t_b * 1e6:8.1f} us  "
              f"speedup {t_b / t_q:.2f}x  (one Llama-3.1-8B layer's 7 matmuls)")
    for m in (16, 256, 2048):
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k_in), jnp.bfloat16)
        xd = jax.random.normal(jax.random.PRNGKey(m + 1), (m, k_down), jnp.bfloat16)
        t_q = median_seconds(f_w4, (x, xd, f8), args.iters)
        t_b = median_seconds(f_bf, (x, xd, bf16), args.iters)
        ratios[f"fp8 M={m}"] = t_b / t_q
        print(f"fp8   M={m:4d}: fp8 dot {t_q * 1e6:8.1f} us  bf16 jnp.dot {t_b * 1e6:8.1f} us  "
              f"speedup {t_b / t_q:.2f}x  (dynamic per-token activation scales included)")
    summary = "  ".join(f"{k}: {v:.2f}x" for k, v in ratios.items())
    print(f"SUMMARY {summary}  (total {time.perf_counter() - t_start:.1f} s)")
    return 0


def cpu_smollm2(iters: int) -> int:
    """The CPU serving paths (XLA) against a float32 dot, at decode (M=32) and prefill (M=512) sizes."""
    from jaxserve.quantization.quantize import quantize_weight

    f32, w4, f8 = weights(SMOLLM2, jax.random.PRNGKey(0), jnp.float32, group=64)
    i8 = [quantize_weight(w, "int8") for w in f32]
    f_q, f_f = jax.jit(run_layer), jax.jit(run_layer_bf16)
    for m in (32, 512):
        x = jax.random.normal(jax.random.PRNGKey(m), (m, 576), jnp.float32)
        xd = jax.random.normal(jax.random.PRNGKey(m + 1), (m, 1536), jnp.float32)
        t_f = median_seconds(f_f, (x, xd, f32), iters)
        line = [f"M={m:3d}: float32 {t_f * 1e6:7.0f} us"]
        for name, ws in (("w4a16", w4), ("fp8", f8), ("int8", i8)):
            t = median_seconds(f_q, (x, xd, ws), iters)
            line.append(f"{name} {t * 1e6:7.0f} us ({t_f / t:.2f}x)")
        print("SmolLM2-135M layer, CPU  " + "  ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
