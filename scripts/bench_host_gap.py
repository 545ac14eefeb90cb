"""The host gap between two device steps, with and without async scheduling.

A device step N ends when its sampled ids are ready; the device can start step N+1 once
step N+1's first program (the model step) is enqueued. The host gap is the time the
device waits in between:

    gap(N) = max(0, enqueue(model step N+1) - ready(step N))

`ready` is taken by a watcher thread that blocks on each step's sampler output (it releases
the GIL while it waits, so it does not slow the host); `enqueue` wraps the runner's model
step call. Synchronous steps pay the whole host side in the gap (read the tokens, update,
detokenize, schedule, prepare); with async scheduling step N+1 is enqueued before step N's
tokens are read, so the gap is what is left of the host work once the device is busy.

The workload: 256 requests (short prompts, long greedy outputs, ignore_eos) all decoding;
after they are all running, K decode steps are measured. Run (CPU, the default model):

    .venv/bin/python scripts/bench_host_gap.py --num-seqs 256 --steps 30

On a GPU machine (no model files): `--random-model llama-3.1-8b` (scripts/gpu_engine.py's shapes).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import jax  # noqa: E402


class Timeline:
    """Enqueue times of each model step and ready times of each sampler output."""

    def __init__(self) -> None:
        self.enqueued: list[float] = []
        self.ready: list[float] = []
        self._watch: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._watch.get()) is not None:
            jax.block_until_ready(item)
            self.ready.append(time.perf_counter())

    def watch(self, tree) -> None:
        self._watch.put(tree)

    def close(self) -> None:
        self._watch.put(None)
        self._thread.join()


def instrument(runner, timeline: Timeline) -> None:
    model_step, dispatch = runner._model_step, runner.dispatch

    def timed_model_step(*a, **k):
        timeline.enqueued.append(time.perf_counter())
        return model_step(*a, **k)

    def watched_dispatch(p):
        pending = dispatch(p)
        if pending.sampled is not None:
            timeline.watch(pending.sampled)
        return pending

    runner._model_step, runner.dispatch = timed_model_step, watched_dispatch


def measure(args, async_scheduling: bool, model) -> dict:
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(max_num_seqs=args.num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, dtype=args.dtype,
                                  num_gpu_blocks_override=args.num_seqs * (-(-args.max_model_len // 16)),
                                  async_scheduling=async_scheduling),
                       model=model, progress=False)
    vocab = engine.model.config.vocab_size
    for i in range(args.num_seqs):
        prompt = [(i * 7919 + j * 104729) % (vocab - 10) + 5 for j in range(args.prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=args.max_model_len - args.prompt_len - 1,
                                          ignore_eos=True))
    while engine.scheduler.stats().num_running < args.num_seqs or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # every request decoding, the async pipeline full
        engine.step()
    timeline = Timeline()
    instrument(engine.runner, timeline)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps
    jax.block_until_ready(engine.runner.kv)
    timeline.close()
    n = min(len(timeline.enqueued) - 1, len(timeline.ready))
    gaps = [max(0.0, timeline.enqueued[i + 1] - timeline.ready[i]) for i in range(n)]
    busy = [timeline.ready[i] - max(timeline.enqueued[i], timeline.ready[i - 1] if i else 0.0) for i in range(n)]
    assert engine.get_stats().num_compilations_after_warmup == 0
    return {"async": async_scheduling, "gap_ms_median": 1e3 * statistics.median(gaps),
            "gap_ms_p90": 1e3 * statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 1 else 1e3 * gaps[0],
            "device_ms_median": 1e3 * statistics.median(busy), "step_ms": 1e3 * wall, "steps": n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None, help="a model path; default: the default model")
    p.add_argument("--random-model", default=None, metavar="SHAPE",
                   help="random weights of a scripts/gpu_engine.py shape (smollm2-135m, llama-3.1-8b)")
    args = p.parse_args()
    if args.random_model:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_engine import random_model

        model = random_model(args.random_model, args.dtype)
    else:
        from jaxserve.weights.loader import load_model

        model = load_model(args.model, args.dtype, progress=False)
    print(f"backend {jax.default_backend()}, {args.num_seqs} sequences decoding, {args.steps} steps")
    for async_scheduling in (False, True):
        r = measure(args, async_scheduling, model)
        print(f"host-gap async={str(r['async']):5}  gap median {r['gap_ms_median']:.3f} ms  p90 "
              f"{r['gap_ms_p90']:.3f} ms  device {r['device_ms_median']:.1f} ms/step  wall {r['step_ms']:.1f} ms/step",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
