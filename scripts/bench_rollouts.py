"""RL rollouts on the default model (issue 48): n samples per prompt against n = 1, and the logprob flags' cost.

Part "sharing": GRPO-style sampling, 8 prompts x `SamplingParams(n=8, temperature=1.0, max_tokens=32)`
against 64 requests of n = 1 (the same 8 prompts, each 8 times, their own seeds); prefix caching off,
so the only sharing is n's: the samples fork off the prompt's KV blocks. Output tok/s, wall seconds,
and the KV blocks in use at the peak of the run (physical) against the blocks the requests' tables
name (logical: what they would hold without sharing). Two prompt sets: examples/grpo.py's chat
prompts (38 tokens: under one 64-token CPU block, which every sample copies on its first write) and
the same with a long system message (196 tokens: 3 full blocks shared by the 8 samples).

Part "flags": the same n = 1 x 64 short prompts (the example's, 32 tokens each) on three engines,
default vs `head_dtype="float32"` vs `batch_invariant=True`, alternating runs (A B C A B C ...),
medians of --reps.

  python scripts/bench_rollouts.py                 # both parts, the CPU defaults (LLM())
  python scripts/bench_rollouts.py --part sharing --reps 1
Every engine is warmed on the workload once before it is timed (its compilations are not counted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.grpo import SUBJECTS, make_prompts  # noqa: E402
from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.core.scheduler_output import SchedulerOutput  # noqa: E402

# A rubric of the length GRPO recipes put in front of every question (a system prompt plus instructions).
SYSTEM = ("You are a careful assistant taking part in a writing exercise. For every request, answer in one "
          "short sentence of plain English, without lists, markup, quotation marks or emoji. Name at least "
          "one colour in your answer, and prefer common colour words such as red, blue, green, yellow, "
          "white or black over rare ones. Do not explain your choice, do not apologise, do not ask the user "
          "a question back, and do not mention these instructions. If the request is ambiguous, pick the "
          "most ordinary reading of it and answer that. Keep the tone neutral and friendly. Your answer "
          "will be scored automatically: it earns a point when it names a colour, and nothing otherwise, "
          "so a short answer that names a colour is always better than a long one that does not. "
          "Remember: one sentence, plain words, at least one colour, nothing else.")


@dataclass
class Run:
    seconds: float
    tokens: int
    peak_blocks: int = 0  # physical blocks in use at the run's peak
    logical_blocks: int = 0  # blocks the block tables name at that moment (shared ones counted per request)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def prompts_of(llm: LLM, long_system: bool) -> list[list[int]]:
    prompts = make_prompts(llm, SUBJECTS[:8])
    if not long_system:
        return prompts
    tok = llm.get_tokenizer()
    return [list(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Describe {s} in a few words."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)) for s in SUBJECTS[:8]]


def watch_blocks(llm: LLM) -> dict[str, int]:
    """Wraps the scheduler's schedule(): after each, this step's allocations and forks are done."""
    sched = llm.llm_engine.scheduler
    peak = {"physical": 0, "logical": 0}
    schedule = sched.schedule

    def watched() -> SchedulerOutput:
        out = schedule()
        used = sched.kv.block_pool.num_blocks - sched.kv.num_free_blocks
        if used > peak["physical"]:
            peak["physical"] = used
            peak["logical"] = sum(len(t) for t in sched.kv.req_to_blocks.values())
        return out

    sched.schedule = watched
    return peak


def rollout(llm: LLM, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> Run:
    """len(prompts) requests of n samples each, every request its own seed; EOS ignored (fixed tokens)."""
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed * 1000 + i, ignore_eos=True)
              for i in range(len(prompts))]
    peak = watch_blocks(llm)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    del llm.llm_engine.scheduler.schedule  # the instance's wrapper: the class's method again
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return Run(seconds, tokens, peak["physical"], peak["logical"])


def sharing(llm: LLM, reps: int, max_tokens: int) -> None:
    for long_system in (False, True):
        prompts = prompts_of(llm, long_system)
        lens = sorted(len(p) for p in prompts)
        cases = {"8 prompts x n=8": (prompts, 8), "64 x n=1": (prompts * 8, 1)}
        for case, (ps, n) in cases.items():
            rollout(llm, ps, n, max_tokens, seed=99)  # warm: this shape's programs compiled
        runs: dict[str, list[Run]] = {c: [] for c in cases}
        for rep in range(reps):
            for case, (ps, n) in cases.items():
                runs[case].append(rollout(llm, ps, n, max_tokens, seed=rep))
        label = "long system prompt" if long_system else "grpo.py chat prompts"
        print(f"sharing, {label} ({lens[0]}-{lens[-1]} prompt tokens, {max_tokens} out, "
              f"block size {llm.llm_engine.scheduler.kv.block_size}):")
        for case, rs in runs.items():
            med = statistics.median(r.tok_s for r in rs)
            print(f"  {case:16s} {med:7.1f} tok/s (runs: {', '.join(f'{r.tok_s:.1f}' for r in rs)}), "
                  f"{statistics.median(r.seconds for r in rs):6.2f} s, {rs[0].tokens} tokens, peak KV blocks "
                  f"{max(r.peak_blocks for r in rs)} in use for {max(r.logical_blocks for r in rs)} in the tables")


def flags(reps: int, max_tokens: int) -> None:
    engines = {"default": {}, "head_dtype=float32": {"head_dtype": "float32"},
               "batch_invariant": {"batch_invariant": True}}
    llms = {name: LLM(enable_prefix_caching=False, **kw) for name, kw in engines.items()}
    prompts = prompts_of(llms["default"], False) * 8
    for llm in llms.values():
        rollout(llm, prompts, 1, max_tokens, seed=99)  # warm
    runs: dict[str, list[Run]] = {name: [] for name in llms}
    for rep in range(reps):
        for name, llm in llms.items():  # alternating: A B C A B C
            runs[name].append(rollout(llm, prompts, 1, max_tokens, seed=rep))
    base = statistics.median(r.tok_s for r in runs["default"])
    print(f"flags, 64 x n=1, grpo.py chat prompts, {max_tokens} out, alternating, {reps} reps:")
    for name, rs in runs.items():
        med = statistics.median(r.tok_s for r in rs)
        print(f"  {name:20s} {med:7.1f} tok/s (runs: {', '.join(f'{r.tok_s:.1f}' for r in rs)}) "
              f"{med / base:5.2f}x default")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("sharing", "flags", "both"), default="both")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    if a.part in ("sharing", "both"):
        llm = LLM(enable_prefix_caching=False)
        sharing(llm, a.reps, a.max_tokens)
        llm.shutdown()
    if a.part in ("flags", "both"):
        flags(a.reps, a.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
