"""The scheduler on randomized workloads against the fake runner's reference outputs
(tests/scheduler_helpers.py): mixed budgets, chunking, preemption and prefix caching, then
random configs with parallel samples and aborts mid-flight, synchronously and asynchronously."""

from __future__ import annotations

import random

import pytest

from jaxserve.core.request import Request
from jaxserve.core.scheduler import ModelOutput, Scheduler, SchedulerConfig, SchedulerOutput
from tests.scheduler_helpers import (FakeRunner, Run, assert_matches_reference, make_request, random_prompt,
                                     run)

# -- mixed workloads: budgets, chunking, preemption, prefix caching -------------
WORKLOADS = [
    # (mode, chunked, prefix caching, num_blocks): 24 blocks of 4 is far below the demand.
    ("recompute", False, False, 24),
    ("recompute", True, False, 24),
    ("recompute", True, True, 24),
    ("swap", False, False, 24),
    ("swap", True, True, 24),
    ("recompute", False, True, 400),  # roomy: no preemption
]


@pytest.mark.parametrize("mode, chunked, caching, num_blocks", WORKLOADS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_workload_matches_reference(mode: str, chunked: bool, caching: bool,
                                          num_blocks: int, seed: int, async_scheduling: bool) -> None:
    rng = random.Random(seed)
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=32 if chunked else 64, max_model_len=64,
                          enable_chunked_prefill=chunked, enable_prefix_caching=caching,
                          preemption_mode=mode, num_cpu_blocks=12 if mode == "swap" else 0)
    shared = random_prompt(rng, 8, 8)  # a common system prompt for prefix hits
    reqs = []
    for i in range(30):
        prompt = (shared if rng.random() < 0.5 else []) + random_prompt(rng, 1, 40)
        reqs.append(make_request(f"r{i}", prompt[:60], arrival=float(i), max_tokens=rng.randint(1, 20),
                                 ignore_eos=rng.random() < 0.5))
    result = run(cfg, [(rng.randint(0, 30), r) for r in reqs], async_scheduling=async_scheduling)
    assert_matches_reference(result, reqs, cfg.max_model_len)
    stats = result.sched.stats()
    assert (stats.num_preemptions > 0) == (num_blocks < 100)
    if mode == "swap" and num_blocks < 100:
        assert any(s.swap_out for s in result.steps) and any(s.swap_in for s in result.steps)
    if caching:
        assert 0 < stats.prefix_cache_hits <= stats.prefix_cache_queries
    if chunked:
        # Some step mixes a prefill chunk that does not sample with other requests' decodes.
        assert any(not s.sample for out in result.steps for s in out.scheduled)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("mode, chunked, caching, num_blocks", [WORKLOADS[2], WORKLOADS[5]])
def test_pipeline_steps_in_flight_hold_disjoint_requests(depth: int, mode: str, chunked: bool, caching: bool,
                                                         num_blocks: int) -> None:
    """Pipeline stages (pipeline_depth P): P steps in flight, a request in at most one of them with a
    sampled row (the harness asserts it), each step a share of the runnable requests, so that P
    sampling steps are in flight at once; outputs still the reference's."""
    rng = random.Random(depth)
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=32 if chunked else 64, max_model_len=64,
                          enable_chunked_prefill=chunked, enable_prefix_caching=caching,
                          preemption_mode=mode, pipeline_depth=depth)
    reqs = [make_request(f"r{i}", random_prompt(rng, 1, 40), arrival=float(i), max_tokens=rng.randint(4, 20),
                         ignore_eos=True) for i in range(24)]
    result = run(cfg, [(rng.randint(0, 10), r) for r in reqs], async_scheduling=True)
    assert_matches_reference(result, reqs, cfg.max_model_len)
    assert result.max_sampling_in_flight == depth


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_pipeline_steps_split_the_running_requests_evenly(depth: int) -> None:
    """12 requests decoding with P steps in flight: each step takes ceil(12 / P) of them, not all
    (which would leave the other stages idle), and every request gets its reference output."""
    cfg = SchedulerConfig(num_blocks=200, block_size=4, max_num_seqs=12, max_num_batched_tokens=64,
                          max_model_len=64, pipeline_depth=depth)
    reqs = [make_request(f"r{i}", [i + 1, 2, 3], max_tokens=16, ignore_eos=True) for i in range(12)]
    result = run(cfg, [(0, r) for r in reqs], async_scheduling=True)
    assert_matches_reference(result, reqs, cfg.max_model_len)
    sizes = [len(o.scheduled) for o in result.steps if o.scheduled]
    share = -(-12 // depth)
    assert max(sizes) == share and sizes.count(share) >= depth * 10, sizes


@pytest.mark.parametrize("seed", range(40))
def test_random_configs_with_forks_and_aborts(seed: int) -> None:
    """Everything at once: random pool/budget/mode, parallel samples, aborts mid-flight; even
    seeds schedule asynchronously (step N's update after step N+1 ran)."""
    rng = random.Random(100 + seed)
    async_scheduling = seed % 2 == 0
    in_flight: list[tuple[SchedulerOutput, ModelOutput]] = []
    chunked = rng.random() < 0.5
    mode = rng.choice(["recompute", "swap"])
    cfg = SchedulerConfig(num_blocks=rng.randint(12, 40), block_size=rng.choice([2, 4, 8]),
                          max_num_seqs=rng.randint(2, 10), max_model_len=48,
                          max_num_batched_tokens=rng.randint(8, 48) if chunked else 48,
                          enable_chunked_prefill=chunked, enable_prefix_caching=rng.random() < 0.5,
                          preemption_mode=mode, num_cpu_blocks=rng.randint(1, 20) if mode == "swap" else 0)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    reqs: list[Request] = []
    aborted: set[str] = set()
    for step in range(3000):
        if step < 40 and rng.random() < 0.4:
            i, prompt = len(reqs), random_prompt(rng, 1, 30)
            params = dict(max_tokens=rng.randint(1, 16), ignore_eos=rng.random() < 0.7)
            try:
                for k in range(rng.choice([1, 1, 3])):
                    rid = f"q{i}" if k == 0 else f"q{i}#{k}"
                    req = make_request(rid, prompt, arrival=float(step), parent=f"q{i}" if k else None, **params)
                    sched.add_request(req)
                    reqs.append(req)
            except ValueError:
                assert k == 0, "siblings are valid when the first one is"
                continue
        if step < 60 and reqs and rng.random() < 0.05:
            victim = rng.choice(reqs).request_id
            aborted |= {r.request_id for r in sched.abort_requests([victim])}
        if step >= 40 and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens and len(out.scheduled) <= cfg.max_num_seqs
        in_flight.append((out, runner.execute(out)))
        while len(in_flight) > int(async_scheduling):
            sched.update(*in_flight.pop(0))
        pool = sched.kv.block_pool
        owned = [b for t in sched.kv.req_to_blocks.values() for b in t]
        assert all(pool.ref_counts[b] == owned.count(b) for b in range(cfg.num_blocks))
    else:
        raise AssertionError("requests did not finish")
    for late in in_flight:  # async: a step scheduled before the last update; its results are dropped
        assert sched.update(*late) == []
    assert sched.kv.num_free_blocks == cfg.num_blocks and sched.kv.cpu_usage == 0.0
    done = [r for r in reqs if r.request_id not in aborted]
    assert all(r.is_finished for r in reqs)
    assert_matches_reference(Run({r.request_id: r for r in done}, [], sched), done, cfg.max_model_len)
