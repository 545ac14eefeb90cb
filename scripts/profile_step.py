"""Where a serving step's time goes: the engine on a log-normal workload, timed by phase.

Runs LLMEngine (the default model unless --model) on BENCHMARKS.md's
workload shape (log-normal prompt and output lengths, all requests at t=0,
greedy, ignore_eos) and times each phase of every step with wall clocks:

    schedule   Scheduler.schedule (host)
    prepare    ModelRunner.prepare: pack the batch, sampler inputs (host)
    model      the jitted model step, dispatch to completion (device)
    sample     LM head + sampler program and the fetch of its tokens (device)
    update     Scheduler.update, detokenization, stop checks, outputs (host)

Steps are split into decode-only steps and steps carrying prompt tokens. Run:

    .venv/bin/python scripts/profile_step.py --num-prompts 64 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.engine.args import KV_CACHE_DTYPES, QUANTIZATIONS, EngineArgs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-median", type=int, default=128)
    p.add_argument("--output-median", type=int, default=128)
    p.add_argument("--sigma", type=float, default=0.7)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    p.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    p.add_argument("--kv-cache-dtype", default=EngineArgs.kv_cache_dtype, choices=KV_CACHE_DTYPES)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=EngineArgs.gpu_memory_utilization)
    p.add_argument("--compilation-cache-dir", default=EngineArgs.compilation_cache_dir)
    p.add_argument("--random-model", default=None, metavar="SHAPE",
                   help="random weights of a shape in scripts/gpu_engine.py (smollm2-135m, llama-3.1-8b) "
                        "instead of --model: the GPU machine has no model files")
    p.add_argument("--num-adapters", type=int, default=0,
                   help="> 0: --enable-lora with this many random PEFT adapters of rank --max-lora-rank "
                        "(scripts/bench_lora.py's), each request under a random one of them")
    p.add_argument("--max-lora-rank", type=int, default=8)
    args = p.parse_args()

    from jaxserve.bench.datasets import lognormal_requests
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.worker import model_runner

    loaded, lora_flags, adapters = None, {}, []
    if args.num_adapters:
        import tempfile
        from pathlib import Path

        import bench_lora  # scripts/ is this script's directory, so on sys.path
        from jaxserve.lora.request import LoRARequest

        paths = bench_lora.make_adapters(Path(tempfile.mkdtemp(prefix="profile_lora_")), args.num_adapters,
                                         args.max_lora_rank)
        adapters = [LoRARequest(f"a{k}", k + 1, path) for k, path in enumerate(paths)]
        lora_flags = dict(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.max_lora_rank)
    if args.random_model:
        import gpu_engine  # scripts/ is this script's directory, so on sys.path
        from jaxserve.weights.loader import resolve_dtype

        loaded = gpu_engine.random_model(args.random_model, resolve_dtype(args.dtype))
    engine = LLMEngine(EngineArgs(
        model=args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        quantization=args.quantization, block_size=args.block_size, dtype=args.dtype,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, compilation_cache_dir=args.compilation_cache_dir,
        **lora_flags), model=loaded)
    if loaded is not None:
        requests = gpu_engine.requests(args.num_prompts, loaded.config.vocab_size, args.seed,
                                       args.input_median, args.output_median, args.sigma)
    else:
        requests = lognormal_requests(engine.tokenizer, args.num_prompts, args.input_median, args.output_median,
                                      args.sigma, (16, 1024), (16, 512), args.seed, as_ids=True)
    print(f"warm-up {engine.warmup_seconds:.1f} s, {engine.num_gpu_blocks} KV blocks, "
          f"backend {engine.runner.rc.backend}, device {jax.devices()[0].device_kind}", flush=True)

    # Wrap each phase with a wall clock; the model step is made synchronous so its time is its own.
    times: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn, sync=False):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            if sync:
                jax.block_until_ready(r)
            times[name] += time.perf_counter() - t0
            return r
        return wrapper

    sched, runner = engine.scheduler, engine.runner
    sched.schedule = timed("schedule", sched.schedule)
    runner.prepare = timed("prepare", runner.prepare)
    runner._model_step = timed("model", runner._model_step, sync=True)
    runner._sample_step = timed("sample", runner._sample_step)
    model_runner._fetch = timed("sample", model_runner._fetch)  # the sampled tokens' device-to-host wait
    if adapters:  # an adapter written into a device slot (host copy -> stacked arrays)
        runner._write_lora = timed("lora_write", runner._write_lora, sync=True)

    picks = np.random.default_rng(1).integers(0, max(1, len(adapters)), len(requests))
    for i, r in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt},
                           SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True),
                           lora_request=adapters[picks[i]] if adapters else None)
    steps = collections.defaultdict(list)  # kind -> [(total, {phase: s}, batched tokens)]
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        times.clear()
        t0 = time.perf_counter()
        orig = sched.schedule
        out_holder = {}

        def grab(*a, **k):
            out_holder["out"] = orig(*a, **k)
            return out_holder["out"]
        sched.schedule = grab
        engine.step()
        sched.schedule = orig
        total = time.perf_counter() - t0
        out = out_holder["out"]
        prompt = any(len(sr.token_ids) > 1 or not sr.sample for sr in out.scheduled)
        phases = dict(times)
        phases["update"] = total - sum(v for k, v in phases.items() if k != "update")  # the rest of step()
        steps["with prompt tokens" if prompt else "decode only"].append((total, phases, out.num_batched_tokens))
    wall = time.perf_counter() - t_start

    n_out, n_in = sum(r.expected_output_len for r in requests), sum(r.prompt_len for r in requests)
    print(f"{args.num_prompts} requests, {n_in} prompt + {n_out} output tokens in {wall:.1f} s: "
          f"{n_out / wall:.1f} output tok/s, {(n_in + n_out) / wall:.1f} total tok/s")
    names = ("schedule", "prepare", "model", "sample", "update") + (("lora_write",) if adapters else ())
    print(f"{'steps':>22} {'n':>5} {'tokens':>7} {'step ms':>8} " + " ".join(f"{n:>9}" for n in names)
          + f" {'share':>6}")
    for kind, rows in steps.items():
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        share = sum(r[0] for r in rows) / wall
        print(f"{kind:>22} {len(rows):>5} {statistics.median(r[2] for r in rows):>7.0f} "
              f"{med([r[0] for r in rows]):>8.1f} "
              + " ".join(f"{med([r[1].get(n, 0.0) for r in rows]):>9.1f}" for n in names)
              + f" {share:>6.0%}")
        print(f"BRIEF {kind} steps (median of {len(rows)}, {statistics.median(r[2] for r in rows):.0f} tokens): "
              f"{med([r[0] for r in rows]):.1f} ms = " + " + ".join(
                  f"{n} {med([r[1].get(n, 0.0) for r in rows]):.1f}" for n in names) + f"; {share:.0%} of the run")
    decode = steps.get("decode only", [])
    if decode:  # how decode-only steps spread over token counts (the bucket grid's concern)
        edges = (0, 2, 4, 8, 16, 24, 32, 48, 64, 1 << 30)
        spread = []
        for lo, hi in zip(edges, edges[1:]):
            rows = [r for r in decode if lo < r[2] <= hi]
            if rows:
                spread.append(f"{lo + 1}-{hi if hi < 1 << 30 else ''}: {len(rows)} steps, "
                              f"{sum(r[0] for r in rows) / wall:.0%} of the time, "
                              f"median {statistics.median(r[0] for r in rows) * 1e3:.0f} ms")
        print("decode-only steps by tokens: " + "; ".join(spread))


if __name__ == "__main__":
    main()
