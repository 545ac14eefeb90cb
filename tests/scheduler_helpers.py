"""The scheduler's test harness: a fake runner that keeps a shadow KV cache.

The fake runner stores, per block slot, the (token, position) it was asked to
write, and samples the next token as a hash of the context it reads back
through the block table, salted per request (so parallel samples diverge).
A request therefore gets the reference tokens only if its blocks really held
its whole context: a missed copy-on-write, a wrong prefix hit, a bad swap or
a lost token changes the output. Used by tests/test_scheduler.py and
tests/test_scheduler_random.py.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from jaxserve.core.request import PLACEHOLDER, Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import (ModelOutput, SampledToken, ScheduledRequest, Scheduler, SchedulerConfig,
                                    SchedulerOutput)

VOCAB = 50
EOS = 0


def salt(request_id: str) -> int:
    return zlib.crc32(request_id.encode()) % 1000


def next_token(context: list[int], s: int) -> int:
    h = s
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], s: int, params: SamplingParams, max_model_len: int) -> list[int]:
    """What the request must produce, computed without any cache."""
    toks, out = list(prompt), []
    while True:
        t = next_token(toks, s)
        toks.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and (t in (params.stop_token_ids or [])
                                              or (not params.ignore_eos and t == EOS)):
            return out
        if (params.max_tokens is not None and len(out) >= params.max_tokens) or len(toks) >= max_model_len:
            return out


class FakeRunner:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.dev: list[list[tuple[int, int] | None]] = [[None] * cfg.block_size for _ in range(cfg.num_blocks)]
        self.cpu: list[list[tuple[int, int] | None]] = [[None] * cfg.block_size
                                                        for _ in range(cfg.num_cpu_blocks)]
        self.last: dict[str, SampledToken] = {}  # the previous step's samples, as the device keeps them

    def write(self, out: SchedulerOutput) -> None:
        """The step's block swaps and copies, then every scheduled token's (token, position) into its
        slot: like the model, every layer writes the whole batch's KV, then attends."""
        bs = self.cfg.block_size
        for d, c in out.swap_out:
            self.cpu[c] = list(self.dev[d])
        for c, d in out.swap_in:
            self.dev[d] = list(self.cpu[c])
        for s, d in out.copy_blocks:
            self.dev[d] = list(self.dev[s])
        for sr in out.scheduled:
            for k, t in enumerate(sr.token_ids):
                if t == PLACEHOLDER:  # async scheduling: the previous step's token, still "on the device"
                    assert k == len(sr.token_ids) - 1 and sr.request_id in self.last, sr
                    t = self.last[sr.request_id].token_id
                p = sr.start_pos + k
                self.dev[sr.block_ids[p // bs]][p % bs] = (t, p)

    def context(self, sr: ScheduledRequest, stop: int) -> list[int]:
        """Tokens [0, stop) read back through the request's block table; each slot must hold its position."""
        bs = self.cfg.block_size
        ctx = [self.dev[sr.block_ids[p // bs]][p % bs] for p in range(stop)]
        assert all(c is not None and c[1] == p for p, c in enumerate(ctx)), sr.request_id
        return [c[0] for c in ctx]

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.write(out)
        sampled = {}
        for sr in out.scheduled:
            if sr.sample:
                end = sr.start_pos + len(sr.token_ids)
                sampled[sr.request_id] = SampledToken(next_token(self.context(sr, end), salt(sr.request_id)))
        self.last = sampled
        return ModelOutput(sampled)


@dataclass
class Run:
    outputs: dict[str, Request]
    steps: list[SchedulerOutput]
    sched: Scheduler
    max_sampling_in_flight: int = 0  # most steps with sampled rows in flight at once


def make_request(rid: str, prompt: list[int], arrival: float = 0.0, parent: str | None = None,
                 **params: object) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(rid, list(prompt), SamplingParams(**params), arrival, eos_token_ids=(EOS,),
                   parent_id=parent)


def run(cfg: SchedulerConfig, arrivals: list[tuple[int, Request]], max_steps: int = 5000,
        check: bool = True, async_scheduling: bool = False) -> Run:
    """Drive schedule/execute/update; `arrivals` are (step, request) pairs. With
    `async_scheduling`, step N's update comes after step N+1 was scheduled and executed; with
    `cfg.pipeline_depth` P > 1 too, after step N+P-1 (as LLMEngine keeps P steps in flight)."""
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    pending = sorted(arrivals, key=lambda a: a[0])
    by_id = {r.request_id: r for _, r in arrivals}
    done: dict[str, Request] = {}
    steps = []
    in_flight: list[tuple[SchedulerOutput, ModelOutput]] = []
    keep = (max(2, cfg.pipeline_depth) - 1) if async_scheduling else 0  # steps left in flight after a step
    most_sampling = 0

    def apply(out: SchedulerOutput, model_out: ModelOutput) -> None:
        for update in sched.update(out, model_out):
            req = by_id[update.request_id]
            assert req.output_token_ids[-len(update.new_tokens):] == [t.token_id for t in update.new_tokens]
            assert update.finished == req.is_finished
            if update.finished:
                done[req.request_id] = req

    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        if not pending and not sched.has_unfinished_requests():
            break
        waiting_before = [r.request_id for r in sched.waiting]
        out = sched.schedule()
        # FCFS: admissions are a prefix of the waiting queue, and none while any are swapped out.
        admitted = [s.request_id for s in out.scheduled if s.request_id in set(waiting_before)]
        assert admitted == waiting_before[:len(admitted)]
        assert not (admitted and sched.swapped)
        # Preemption takes the newest: no victim is older than a request that ran this step.
        arrival = {r: sched.requests[r].arrival_time for r in sched.requests}
        for victim in out.preempted_ids:
            assert all(arrival[victim] >= arrival[s.request_id] for s in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        if cfg.pipeline_depth > 1:  # a request waits for its sampled step's update before it runs again
            busy = {s.request_id for o, _ in in_flight for s in o.scheduled if s.sample}
            assert not busy & {s.request_id for s in out.scheduled}, (busy, out.scheduled)
        steps.append(out)
        in_flight.append((out, runner.execute(out)))
        most_sampling = max(most_sampling, sum(any(s.sample for s in o.scheduled) for o, _ in in_flight))
        while len(in_flight) > keep:
            apply(*in_flight.pop(0))
    else:
        raise AssertionError("requests did not finish")
    if check:
        assert sched.kv.num_free_blocks == cfg.num_blocks, "pool fully free at the end"
        assert sched.kv.cpu_usage == 0.0
    return Run(done, steps, sched, most_sampling)


def assert_matches_reference(result: Run, requests: list[Request], max_model_len: int) -> None:
    for req in requests:
        got = result.outputs[req.request_id]
        want = reference(req.prompt_token_ids, salt(req.request_id), req.sampling_params, max_model_len)
        assert got.output_token_ids == want, req.request_id


def random_prompt(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))]
