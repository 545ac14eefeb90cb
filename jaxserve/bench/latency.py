"""`jaxserve bench latency`: one batch of --batch-size prompts of --input-len tokens, each generating
exactly --output-len tokens, run --num-iters times after --num-iters-warmup; latency percentiles."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from jaxserve.bench import datasets as ds
from jaxserve.bench.throughput import add_engine_args, make_llm

PERCENTILES = (10, 25, 50, 75, 90, 99)


def run_latency(llm, batch_size: int, input_len: int, output_len: int, num_iters: int, num_iters_warmup: int,
                *, seed: int = 0, progress: bool = True) -> dict[str, object]:
    from jaxserve.core.sampling_params import SamplingParams

    reqs = ds.random_requests(ds.HFTokenizer(llm.get_tokenizer()), batch_size, input_len, output_len, seed=seed)
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(num_iters_warmup), desc="Warm-up iterations", disable=not progress):
        once()
    latencies = [once() for _ in tqdm(range(num_iters), desc="Profiling iterations", disable=not progress)]
    arr = np.asarray(latencies)
    return {"avg_latency": float(arr.mean()), "latencies": latencies,
            "percentiles": {str(q): float(np.percentile(arr, q)) for q in PERCENTILES},
            "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "output_tokens_per_second": batch_size * output_len / float(arr.mean())}


def format_result(res: dict[str, object]) -> str:
    pct = res["percentiles"]
    lines = [f"Avg latency: {res['avg_latency']:.3f} s (batch {res['batch_size']}, {res['input_len']} in / "
             f"{res['output_len']} out; {res['output_tokens_per_second']:.1f} output tokens/s)"]
    lines += [f"{q}% percentile latency: {pct[str(q)]:.3f} s" for q in PERCENTILES]  # type: ignore[index]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    if min(args.batch_size, args.input_len, args.output_len, args.num_iters) < 1 or args.num_iters_warmup < 0:
        raise SystemExit("bench latency: batch size, lengths and --num-iters must be >= 1")
    llm = make_llm(args)
    res = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters, args.num_iters_warmup,
                      seed=args.seed, progress=not args.disable_tqdm)
    print(format_result(res))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(res, indent=1))
    return 0
