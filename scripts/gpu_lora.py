"""The LoRA Pallas kernel (pallas_kernels/lora_shrink_expand.py) against the XLA one-hot path on a
GPU, at Llama-3.1-8B's layer shapes: 8 adapters of rank 16 in bfloat16, every token a random slot
(0 = no adapter included), M = 1, 16 and 64 tokens.

One "layer" is the seven LoRA deltas of a Llama-3.1-8B decoder layer (K x N: q, o 4096x4096; k, v
4096x1024; gate, up 4096x14336; down 14336x4096), jitted as one program per path and M, through
jaxserve/lora/layers.delta (the model's own hook: a LoRAStep with the kernel, or the bare mask for
the XLA product). Prints per M the largest difference of the kernel's deltas from the XLA path's
(relative to the output range), both times, and the base layer's seven bf16 matmuls for scale; a
BRIEF line for scripts/gpu_check.sh's summary.

  python scripts/gpu_lora.py              # on the GPU (< 60 s)
  python scripts/gpu_lora.py --cpu-smoke  # tiny shapes, the kernel in interpret mode (any machine)
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

from gpu_quant import median_seconds  # noqa: E402  (scripts/: the script's own directory)
from jaxserve.lora import layers  # noqa: E402

LAYER = {"wq": (4096, 4096), "wk": (4096, 1024), "wv": (4096, 1024), "wo": (4096, 4096),
         "w_gate": (4096, 14336), "w_up": (4096, 14336), "w_down": (14336, 4096)}
SMOKE = {"wq": (128, 128), "wk": (128, 64), "wv": (128, 64), "wo": (128, 128),
         "w_gate": (128, 256), "w_up": (128, 256), "w_down": (256, 128)}
NUM_SLOTS, RANK = 8, 16
TOLERANCE = 2e-2  # bfloat16 outputs; both paths accumulate in float32


def slots_and_weights(shapes: dict, dtype) -> tuple[dict, dict, jax.Array]:
    """Each projection's stacked slots (a [K, S*R], b [S*R, N]) and its base weight [K, N], random; owner [S, R]."""
    key = jax.random.PRNGKey(0)
    lora, base = {}, {}
    for i, (m, (k, n)) in enumerate(shapes.items()):
        ka, kb, kw = jax.random.split(jax.random.fold_in(key, i), 3)
        lora[m] = {"a": (jax.random.normal(ka, (k, NUM_SLOTS * RANK), jnp.float32) / np.sqrt(k)).astype(dtype),
                   "b": (jax.random.normal(kb, (NUM_SLOTS * RANK, n), jnp.float32) * 0.1).astype(dtype)}
        base[m] = (jax.random.normal(kw, (k, n), jnp.float32) * 0.02).astype(dtype)
    owner = (jnp.arange(NUM_SLOTS * RANK, dtype=jnp.int32) // RANK + 1).reshape(NUM_SLOTS, RANK)
    return lora, base, owner


def deltas(x, x_down, slots, owner, lora, kernel: str):
    """The layer's seven deltas; kernel "": the XLA one-hot product, else the Pallas kernel."""
    step = layers.step_inputs(slots, owner, kernel)
    return [layers.delta(x_down if m == "w_down" else x, ab, step if kernel else step.mask, m)
            for m, ab in lora.items()]


def base_layer(x, x_down, base):
    return [jnp.dot(x_down if m == "w_down" else x, w) for m, w in base.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, the kernel in interpret mode")
    args = ap.parse_args()
    shapes, kernel, iters = (SMOKE, "interpret", 2) if args.cpu_smoke else (LAYER, "pallas", args.iters)
    dtype = jnp.bfloat16
    t_start = time.perf_counter()
    print(f"devices: {jax.devices()}  jax {jax.__version__}  {NUM_SLOTS} slots of rank {RANK}, {dtype.__name__}")
    lora, base, owner = slots_and_weights(shapes, dtype)
    k_in, k_down = shapes["wq"][0], shapes["w_down"][0]
    f_kernel = jax.jit(lambda *a: deltas(*a, lora, kernel))
    f_xla = jax.jit(lambda *a: deltas(*a, lora, ""))
    f_base = jax.jit(lambda x, xd: base_layer(x, xd, base))
    rng = np.random.default_rng(0)
    worst, briefs = 0.0, []
    for m in (1, 16, 64):
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k_in), jnp.float32).astype(dtype)
        xd = jax.random.normal(jax.random.PRNGKey(m + 1), (m, k_down), jnp.float32).astype(dtype)
        slots = jnp.asarray(rng.integers(0, NUM_SLOTS + 1, m), jnp.int32)
        got, want = f_kernel(x, xd, slots, owner), f_xla(x, xd, slots, owner)
        err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                        / max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))), 1e-30)) for g, w in zip(got, want))
        worst = max(worst, err)
        t_k = median_seconds(f_kernel, (x, xd, slots, owner), iters)
        t_x = median_seconds(f_xla, (x, xd, slots, owner), iters)
        t_b = median_seconds(f_base, (x, xd), iters)
        print(f"M={m:3d}: max error {err:.2e} of the output range; kernel {t_k * 1e6:8.1f} us  XLA one-hot "
              f"{t_x * 1e6:8.1f} us  ({t_x / t_k:.2f}x)  base layer's matmuls {t_b * 1e6:8.1f} us", flush=True)
        briefs.append(f"M={m}: kernel {t_k * 1e6:.0f} us vs XLA {t_x * 1e6:.0f} us ({t_x / t_k:.2f}x), "
                      f"base {t_b * 1e6:.0f} us, err {err:.1e}")
    status = "ALL PASS" if worst <= TOLERANCE else f"SOME CHECKS FAILED (error {worst:.2e} > {TOLERANCE})"
    where = "tiny shapes, interpret mode" if args.cpu_smoke else "one Llama-3.1-8B layer"
    print(f"BRIEF lora kernel vs XLA, {where}, {NUM_SLOTS}x rank {RANK}: " + "; ".join(briefs)
          + f"; {status} (total {time.perf_counter() - t_start:.1f} s)")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
