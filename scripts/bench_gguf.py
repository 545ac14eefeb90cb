"""`--quantization gguf` against float32 and int8 on the CPU: one matmul, then the engine's decode step.

    python scripts/bench_gguf.py --matmul                       # x [M, K] @ w, the 0.5B model's shapes
    python scripts/bench_gguf.py --engine [--model X.gguf]      # decode ms a step, resident weight bytes

--matmul: jitted x @ w at M = 1, 16, 64 over Qwen2.5-0.5B's projections (gate/up 896 -> 4864,
down 4864 -> 896, q/o 896 -> 896) for a float32 weight, the int8 (W8A8) weight `--quantization int8`
makes, and a GGUFWeight of each block type whose block fits K (random blocks); median of --reps.
--engine: for each of float32 / int8 / gguf an eager engine (enforce_eager: programs compile on first
use; an untimed run of the same requests compiles them), then greedy decode of B sequences of
--tokens tokens with ignore_eos: milliseconds per step (wall / tokens, the short prefill included),
and the weights' resident bytes (a tied head counted once) against the GGUF file's tensor bytes.
--quantizations picks among float32,int8,gguf; --one-row on|off forces the 1-token model bucket and
1-row sampler bucket a one-sequence decode runs with (default: the engine's choice, gguf weights only).
One run each, small: a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization import gguf_packed as gp
from jaxserve.quantization.matmul import matmul
from jaxserve.quantization.quantize import quantize_weight

SHAPES = {"gate/up": (896, 4864), "down": (4864, 896), "q/o": (896, 896)}  # (K, N)


def _median_ms(f, *args, reps: int) -> float:
    f(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def _random_gguf(qtype: str, n: int, k: int, rng: np.random.Generator) -> gp.GGUFWeight:
    block, size = gp.BLOCKS[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    offsets = {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(qtype, (0,))
    for off in offsets:
        raw[..., off:off + 2] = rng.normal(0, 0.01, (n, k // block)).astype(np.float16).view(np.uint8).reshape(
            n, k // block, 2)
    return jax.tree.map(jnp.asarray, gp.pack(raw.reshape(n, -1), qtype, n, k))


def bench_matmul(reps: int) -> None:
    rng = np.random.default_rng(0)
    f = jax.jit(matmul)
    print("| shape (K x N) | M | float32 ms | int8 ms | " + " | ".join(f"{t} ms" for t in gp.PACKED_TYPES) + " |")
    for name, (k, n) in SHAPES.items():
        wf = jnp.asarray(rng.normal(0, 0.02, (k, n)).astype(np.float32))
        wi = quantize_weight(wf)
        wg = {t: _random_gguf(t, n, k, rng) for t in gp.PACKED_TYPES if k % gp.BLOCKS[t][0] == 0}
        if name == "gate/up":
            sizes = {"float32": wf.nbytes, "int8": wi.nbytes, **{t: w.nbytes for t, w in wg.items()}}
            print("weight bytes:", ", ".join(f"{t} {b / 2**20:.2f} MiB" for t, b in sizes.items()))
        for m in (1, 16, 64):
            x = jnp.asarray(rng.normal(0, 1, (m, k)).astype(np.float32))
            cells = [_median_ms(f, x, wf, reps=reps), _median_ms(f, x, wi, reps=reps)]
            cells += [_median_ms(f, x, wg[t], reps=reps) if t in wg else float("nan") for t in gp.PACKED_TYPES]
            print(f"| {name} {k} x {n} | {m} | " + " | ".join("-" if np.isnan(c) else f"{c:.2f}" for c in cells) + " |",
                  flush=True)


def _unique_bytes(params) -> int:
    seen, total = set(), 0
    for leaf in jax.tree.leaves(params):
        if id(leaf) not in seen:  # a tied head is the embedding's own arrays
            seen.add(id(leaf))
            total += leaf.nbytes
    return total


def bench_engine(model: str | None, batches: list[int], tokens: int, quantizations: list[str | None],
                 one_row: str = "auto") -> None:
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.worker import model_runner
    if one_row != "auto":  # the 1-row buckets forced on or off, whatever the weights (a measurement knob)
        model_runner.one_row_buckets = lambda params: one_row == "on"
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.weights.gguf_file import read_header
    from jaxserve.weights.source import resolve_model_path

    path = resolve_model_path(model)
    header, _ = read_header(path)
    file_bytes = sum(t.data.nbytes for t in header.tensors.values())
    print(f"model {path.name}: GGUF tensor bytes {file_bytes / 2**20:.1f} MiB; load average {os.getloadavg()[0]:.1f}")
    print("| quantization | resident weights MiB | x file | " + " | ".join(f"B={b} ms/step" for b in batches) + " |")
    print(f"one-row buckets: {one_row}")
    for quantization in quantizations:
        llm = LLM(model, quantization=quantization, enforce_eager=True, max_model_len=256, max_num_seqs=max(batches),
                  max_num_batched_tokens=256, progress=False)
        resident = _unique_bytes(llm.llm_engine.model.params)
        cells = []
        for b in batches:
            prompts = [f"Write a story about the number {i}." for i in range(b)]
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)  # compiles every program the timed run uses
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            cells.append((time.perf_counter() - t) / tokens * 1e3)
        print(f"| {quantization or 'float32'} | {resident / 2**20:.1f} | {resident / file_bytes:.2f} | "
              + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)
        del llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matmul", action="store_true")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quantizations", default="float32,int8,gguf")
    ap.add_argument("--one-row", choices=("auto", "on", "off"), default="auto",
                    help="the 1-token / 1-row buckets: as the engine picks (gguf weights only), or forced")
    args = ap.parse_args()
    if args.matmul:
        bench_matmul(args.reps)
    if args.engine:
        quantizations = [None if q == "float32" else q for q in args.quantizations.split(",")]
        bench_engine(args.model, [int(b) for b in args.batches.split(",")], args.tokens, quantizations, args.one_row)


if __name__ == "__main__":
    main()
