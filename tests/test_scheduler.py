"""The scheduler, driven by the fake runner of tests/scheduler_helpers.py (a shadow KV cache:
a request gets the reference tokens only if its blocks really held its whole context):
config and admission, stop conditions, chunked prefill, preemption, forks, aborts, prefix
caching. Randomized workloads are in tests/test_scheduler_random.py."""

from __future__ import annotations

import random

import pytest

from jaxserve.core.request import RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from tests.scheduler_helpers import (EOS, FakeRunner, Run, assert_matches_reference, make_request, random_prompt,
                                     reference, run, salt)


# -- config and admission -----------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=8, max_num_batched_tokens=64, max_model_len=128), "max_num_batched_tokens"),
    (dict(num_blocks=8, preemption_mode="swap"), "num_cpu_blocks"),
    (dict(num_blocks=8, preemption_mode="lru"), "preemption_mode"),
    (dict(num_blocks=8, max_num_seqs=0), "max_num_seqs"),
])
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SchedulerConfig(**kwargs)


def test_config_accepts_chunked_small_budget() -> None:
    SchedulerConfig(num_blocks=8, max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=True)


def test_admission_errors() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=4, max_model_len=32, max_num_batched_tokens=32))
    with pytest.raises(ValueError, match="32 tokens.*max_model_len is 32"):
        sched.add_request(make_request("long", [1] * 32))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(make_request("empty", []))
    # 20 prompt tokens + 8 outputs need 7 blocks of 4; the pool has 4.
    with pytest.raises(ValueError, match="20 tokens.*only 4"):
        sched.add_request(make_request("big", [1] * 20))
    sched.add_request(make_request("ok", [1] * 8))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", [1] * 8))
    assert sched.stats().num_waiting == 1


# -- basic flow ---------------------------------------------------------------
def test_request_token_views() -> None:
    req = make_request("a", [1, 2, 3])
    req.output_token_ids += [4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids_between(start, end) == req.all_token_ids[start:end]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (5, 3, 2)
    assert req.finish_reason is None and not req.is_finished
    req.status = RequestStatus.FINISHED_ABORTED
    assert req.is_finished and req.finish_reason == "abort"
    assert RequestStatus.is_finished(RequestStatus.FINISHED_LENGTH)


def test_single_request_and_stats() -> None:
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    req = make_request("a", [5, 6, 7, 8, 9], max_tokens=6, ignore_eos=True)
    result = run(cfg, [(0, req)])
    assert_matches_reference(result, [req], 64)
    first = result.steps[0].scheduled[0]
    assert first.token_ids == [5, 6, 7, 8, 9] and first.start_pos == 0 and first.sample
    assert len(first.block_ids) == 2
    second = result.steps[1].scheduled[0]
    assert second.start_pos == 5 and second.token_ids == req.output_token_ids[:1]
    assert req.finish_reason == "length" and len(result.steps) == 6
    stats = result.sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


@pytest.mark.parametrize("params, reason", [
    (dict(max_tokens=3, ignore_eos=True), "length"),
    (dict(max_tokens=None, ignore_eos=True), "length"),  # stops at max_model_len
    (dict(max_tokens=40, min_tokens=0), "stop"),
    (dict(max_tokens=40, min_tokens=30, ignore_eos=False), None),
])
def test_stop_conditions(params: dict, reason: str | None) -> None:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=48, max_num_batched_tokens=48)
    reqs = [make_request(f"r{i}", [i + 1, 2, 3], **params) for i in range(20)]
    result = run(cfg, [(0, r) for r in reqs])
    assert_matches_reference(result, reqs, 48)
    reasons = {r.finish_reason for r in result.outputs.values()}
    if reason is not None:
        assert reason in reasons
    for r in result.outputs.values():
        assert r.num_tokens <= 48
        if r.finish_reason == "stop":
            assert r.output_token_ids[-1] == EOS and r.stop_reason is None
            assert r.num_output_tokens >= r.sampling_params.min_tokens


def test_stop_token_ids_set_stop_reason() -> None:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    probe = reference([1, 2, 3], salt("s"), SamplingParams(max_tokens=10, ignore_eos=True), 64)
    req = make_request("s", [1, 2, 3], max_tokens=10, ignore_eos=True, stop_token_ids=[probe[2]])
    result = run(cfg, [(0, req)])
    assert req.output_token_ids == probe[:probe.index(probe[2]) + 1]
    assert req.finish_reason == "stop" and req.stop_reason == probe[2]
    assert result.sched.get_request("s") is None


def test_finish_requests_for_stop_strings() -> None:
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=32)
    sched = Scheduler(cfg)
    runner = FakeRunner(cfg)
    sched.add_request(make_request("a", [1, 2, 3], ignore_eos=True))
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 8
    with pytest.raises(ValueError):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


def test_chunked_prefill_splits_long_prompt_and_shares_steps_with_decodes() -> None:
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=128,
                          enable_chunked_prefill=True)
    short = make_request("short", [1, 2, 3], arrival=0.0, max_tokens=20, ignore_eos=True)
    long = make_request("long", list(range(1, 51)), arrival=1.0, max_tokens=2, ignore_eos=True)
    result = run(cfg, [(0, short), (1, long)])
    assert_matches_reference(result, [short, long], 128)
    chunks = [s for out in result.steps for s in out.scheduled if s.request_id == "long" and s.start_pos < 50]
    assert len(chunks) >= 4 and [c.sample for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(len(c.token_ids) for c in chunks) == 50
    # The decode of "short" rides along in the steps that carry the long prompt's chunks.
    for out in result.steps[1:len(chunks) + 1]:
        assert [s.request_id for s in out.scheduled] == ["short", "long"]
    assert [o.num_batched_tokens for o in result.steps[1:len(chunks) + 1]] == [16, 16, 16, 6]


def test_fcfs_long_prompt_is_not_starved() -> None:
    # No chunking: the 60-token prompt needs almost a whole step's budget; short
    # requests arriving after it must not overtake it while it waits.
    cfg = SchedulerConfig(num_blocks=200, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                          max_model_len=64)
    early = [make_request(f"e{i}", [i + 1] * 3, arrival=float(i), max_tokens=30, ignore_eos=True)
             for i in range(8)]
    long = make_request("long", [7] * 60, arrival=10.0, max_tokens=3, ignore_eos=True)
    late = [make_request(f"l{i}", [i + 1] * 3, arrival=20.0 + i, max_tokens=3, ignore_eos=True)
            for i in range(8)]
    arrivals = [(0, r) for r in early] + [(1, long)] + [(2, r) for r in late]
    result = run(cfg, arrivals)
    assert_matches_reference(result, early + [long] + late, 64)
    first_step = {}
    for k, out in enumerate(result.steps):
        for s in out.scheduled:
            first_step.setdefault(s.request_id, k)
    assert all(first_step["long"] <= first_step[r.request_id] for r in late)
    assert first_step["long"] > 1, "it had to wait for the decodes' budget"


def test_recompute_preemption_requeues_at_front_and_keeps_outputs() -> None:
    cfg = SchedulerConfig(num_blocks=6, block_size=4, max_num_batched_tokens=32, max_model_len=32)
    a = make_request("a", [1] * 7, arrival=0.0, max_tokens=9, ignore_eos=True)
    b = make_request("b", [2] * 7, arrival=1.0, max_tokens=9, ignore_eos=True)
    c = make_request("c", [3] * 9, arrival=2.0, max_tokens=2, ignore_eos=True)  # waits: 3 blocks
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    for r in (a, b, c):
        sched.add_request(r)
    preempted_out = None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out.preempted_ids and preempted_out is None:
            preempted_out = out
            assert out.preempted_ids == ["b"], "the newest is preempted"
            assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
            assert b.num_output_tokens > 0 and list(sched.waiting) == [b, c]
            assert [s.request_id for s in out.scheduled] == ["a"]
        sched.update(out, runner.execute(out))
    assert preempted_out is not None
    assert_matches_reference(Run({"a": a, "b": b, "c": c}, [], sched), [a, b, c], 32)
    assert sched.kv.num_free_blocks == 6


def test_lone_request_that_outgrows_others_keeps_running() -> None:
    # Two requests each needing most of the pool: the oldest always finishes first.
    cfg = SchedulerConfig(num_blocks=5, block_size=4, max_num_batched_tokens=32, max_model_len=32,
                          preemption_mode="swap", num_cpu_blocks=2)  # cpu pool too small: recompute
    reqs = [make_request(f"r{i}", [i + 1] * 6, arrival=float(i), max_tokens=14, ignore_eos=True)
            for i in range(3)]
    result = run(cfg, [(0, r) for r in reqs])
    assert_matches_reference(result, reqs, 32)
    assert result.sched.stats().num_preemptions > 0
    finish_order = [s.request_id for out in result.steps for s in out.scheduled]
    last_step = {rid: max(i for i, r in enumerate(finish_order) if r == rid) for rid in ("r0", "r1", "r2")}
    assert last_step["r0"] < last_step["r1"] < last_step["r2"]


# -- parallel sampling --------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [6, 8])  # last prompt block partly / exactly full
@pytest.mark.parametrize("parent_tokens", [1, 10])  # 1: the parent finishes on its first token
def test_parallel_samples_fork_with_copy_on_write(prompt_len: int, parent_tokens: int) -> None:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    prompt = list(range(1, prompt_len + 1))
    parent = make_request("p", prompt, max_tokens=parent_tokens, ignore_eos=True)
    kids = [make_request(f"p#{i}", prompt, parent="p", max_tokens=10, ignore_eos=True) for i in (1, 2)]
    result = run(cfg, [(0, parent)] + [(0, k) for k in kids])
    assert_matches_reference(result, [parent] + kids, 64)
    assert len({tuple(k.output_token_ids) for k in kids + [parent]}) > 1, "samples diverge"
    first, second = result.steps[0], result.steps[1]
    assert [s.request_id for s in first.scheduled] == ["p"], "children wait for the prefill"
    forked = [s for s in second.scheduled if s.request_id != "p"]
    assert [(s.start_pos, len(s.token_ids)) for s in forked] == [(prompt_len - 1, 1)] * 2
    # Shared prefix blocks; the written last prompt block is copied (unless the parent is gone).
    assert second.copy_blocks
    for s in forked:
        assert s.block_ids[0] == first.scheduled[0].block_ids[0]
    assert result.sched.stats().prefix_cache_queries == 0


def test_child_whose_parent_is_aborted_prefills_alone() -> None:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    sched.add_request(make_request("p", [1, 2, 3, 4, 5]))
    kid = make_request("p#1", [1, 2, 3, 4, 5], parent="p", max_tokens=5, ignore_eos=True)
    sched.add_request(kid)
    assert sched.stats().num_waiting == 2
    assert [r.request_id for r in sched.abort_requests(["p", "nope"])] == ["p"]
    runner = FakeRunner(cfg)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    assert_matches_reference(Run({"p#1": kid}, [], sched), [kid], 64)
    assert sched.kv.num_free_blocks == 32


# -- abort, prefix cache --------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_in_every_state_frees_everything(mode: str) -> None:
    cfg = SchedulerConfig(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                          max_model_len=32, preemption_mode=mode, num_cpu_blocks=16,
                          enable_prefix_caching=True)
    rng = random.Random(3)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    for i in range(12):
        sched.add_request(make_request(f"r{i}", random_prompt(rng, 3, 12), arrival=float(i),
                                       max_tokens=15, ignore_eos=True))
        sched.add_request(make_request(f"r{i}#1", sched.get_request(f"r{i}").prompt_token_ids,
                                       arrival=float(i), parent=f"r{i}", max_tokens=15, ignore_eos=True))
    statuses = set()
    for step in range(12):
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        statuses |= {r.status for r in sched.requests.values()}
    assert {RequestStatus.RUNNING, RequestStatus.WAITING} <= statuses
    if mode == "swap":
        assert RequestStatus.SWAPPED in statuses
    aborted = sched.abort_requests(list(sched.requests))
    assert all(r.finish_reason == "abort" for r in aborted)
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == 10 and sched.kv.cpu_usage == 0.0
    assert sched.schedule().scheduled == []


def test_prefix_cache_hits_on_repeated_prompt() -> None:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=64,
                          enable_prefix_caching=True)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks
    a = make_request("a", prompt, max_tokens=3, ignore_eos=True)
    b = make_request("b", prompt, max_tokens=3, ignore_eos=True)
    c = make_request("c", prompt[:16], max_tokens=3, ignore_eos=True)  # exactly 4 blocks
    result = run(cfg, [(0, a), (5, b), (10, c)])
    assert_matches_reference(result, [a, b, c], 64)
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 16, 12)
    b_first = next(s for out in result.steps for s in out.scheduled if s.request_id == "b")
    assert b_first.start_pos == 16 and b_first.token_ids == prompt[16:]
    stats = result.sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18 + 18 + 16, 28)
