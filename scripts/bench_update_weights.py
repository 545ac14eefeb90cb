"""update_weights' seconds against the physical floor, one copy of the weights' bytes (issue 48).

A trainer in the engine's process hands it new weights every RL step; what that costs, per path:
    tree       engine_params()' structure, arrays already on the engine's shardings (a JAX trainer
               training the engine's own tree): adopted, no copy; the cost is the NaN/inf check
    names/jax  get_weights()' {HF name: jax.Array} on the device: per leaf, one program transposes,
               stacks and casts (one copy)
    names/np   the same names as numpy (a checkpoint read from disk): stacked on the host, one device_put
    tp2/tree   --tp 2: a TP 1 tree (every leaf whole on device 0) resharded onto the TP 2 engine
    tp2/names  --tp 2: HF names, jax arrays on device 0, split onto the TP 2 shardings
The floor: one jitted `x + 1` over every leaf (reads and writes the bytes once), on the same devices.
Each figure is the median of --reps calls after one untimed call (which compiles what it needs).

  python scripts/bench_update_weights.py                       # the default model, CPU, TP 1
  python scripts/bench_update_weights.py --tp 2                # on 2 host devices (set here on a CPU)
  python scripts/bench_update_weights.py --model qwen3-0.6b --dtype bfloat16   # GPU stage, random weights
  python scripts/bench_update_weights.py --model llama-3.1-8b --dtype bfloat16 --skip-numpy
  python scripts/bench_update_weights.py --model tiny --reps 2  # smoke
Prints one line per path and a BRIEF line (scripts/gpu_check.sh's summary).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default (SmolLM2-135M), or random weights at "
                   "tiny / smollm2-135m / qwen3-0.6b / llama-3.1-8b shapes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=1, help="2: also the TP 1 -> TP 2 reshard")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-numpy", action="store_true", help="skip the host path (an 8B model's 16 GB on the host)")
    return p.parse_args()


ARGS = _args()
if ARGS.tp > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # (only seen by the CPU backend: a GPU run keeps its devices)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.tp}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# Qwen3-0.6B's shapes as a Llama (its q/k norms, 2 x 28 x 128 floats, left out: bytes are what count)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=16,
              enforce_eager=True, compilation_cache_dir="")  # nothing is generated: no warm-up


def load(name: str, dtype: str):
    if name == "default":
        from jaxserve.weights.loader import load_model
        return load_model(None, dtype=dtype, progress=False)
    from scripts import gpu_engine
    gpu_engine.SHAPES.setdefault("qwen3-0.6b", QWEN3_06B)
    return gpu_engine.random_model(name, dtype)


def median_s(fn, reps: int) -> float:
    fn()  # compiles what it needs
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def floor_s(tree, reps: int) -> float:
    """One read and one write of every byte: the least any update that moves the bytes costs."""
    copy = jax.jit(lambda t: jax.tree.map(lambda x: x + jnp.ones((), x.dtype), t))
    return median_s(lambda: jax.block_until_ready(copy(tree)), reps)


def timed_update(llm, weights, reps: int) -> float:
    def once():
        llm.update_weights(weights)
        jax.block_until_ready(jax.tree.leaves(llm.engine_params()))
    return median_s(once, reps)


def main() -> int:
    from jaxserve import LLM

    model = load(ARGS.model, ARGS.dtype)
    llm = LLM(model, progress=False, dtype=ARGS.dtype, **ENGINE)
    params = llm.engine_params()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    floor = floor_s(params, ARGS.reps)
    trainer = jax.tree.map(lambda x: x * jnp.ones((), x.dtype), params)  # new arrays, the engine's shardings
    jax.block_until_ready(trainer)
    rows = {"tree": timed_update(llm, trainer, ARGS.reps)}
    if ARGS.tp == 1:
        del trainer  # (an 8B model: 16 GB the engine no longer needs once another update replaces it)
    named = llm.get_weights()
    rows["names/jax"] = timed_update(llm, named, ARGS.reps)
    if not ARGS.skip_numpy:
        rows["names/np"] = timed_update(llm, {k: np.asarray(v) for k, v in named.items()}, ARGS.reps)
    if ARGS.tp > 1:
        if len(jax.devices()) < ARGS.tp:
            print(f"tp {ARGS.tp}: only {len(jax.devices())} devices; reshard skipped")
        else:
            llm.shutdown()
            tp = LLM(model, progress=False, dtype=ARGS.dtype, tensor_parallel_size=ARGS.tp, **ENGINE)
            tp_floor = floor_s(tp.engine_params(), ARGS.reps)
            rows[f"tp{ARGS.tp}/tree"] = timed_update(tp, trainer, ARGS.reps)  # whole leaves on device 0
            rows[f"tp{ARGS.tp}/names"] = timed_update(tp, named, ARGS.reps)
            print(f"floor at TP {ARGS.tp} (one copy, split over {ARGS.tp} devices): {tp_floor:.4f} s")
    dev = jax.devices()[0]
    print(f"{ARGS.model} {ARGS.dtype}: {nbytes / 2**20:.0f} MiB of weights on {dev.platform} ({dev.device_kind}); "
          f"floor (one copy) {floor:.4f} s = {nbytes / floor / 1e9:.1f} GB/s")
    for name, s in rows.items():
        print(f"  {name:12s} {s:8.4f} s  {s / floor:6.2f} x floor")
    print("BRIEF update_weights " + ARGS.model + ": " + ", ".join(f"{k} {v:.3f}s" for k, v in rows.items())
          + f" (floor {floor:.3f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
