"""Speculative decoding with n-gram drafts: the proposer, the config, and the scheduler's
accept / roll-back, driven by a fake runner whose "model" repeats itself with glitches (so
drafts are both accepted and rejected) and reads every context back from its shadow KV cache."""

from __future__ import annotations

import random

import pytest

from jaxserve.engine.args import EngineArgs
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ModelOutput, SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.core.spec_decode import SpeculativeConfig, draft_share, propose_ngram
from tests.scheduler_helpers import FakeRunner

EOS = 0
VOCAB = 40


# -- the proposer -----------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, k, n_min, n_max, want", [
    ([1, 2, 3, 4, 1, 2], 3, 1, 3, [3, 4, 1]),  # suffix [1, 2] seen at 0: what followed it
    ([1, 2, 3, 4, 1, 2], 5, 1, 3, [3, 4, 1, 2, 3]),  # past the end: the loop 1 2 3 4 goes on
    ([5, 1, 2, 9, 1, 2, 7, 2], 2, 1, 3, [7, 2]),  # only [2] recurs: its latest occurrence wins
    ([5, 1, 2, 9, 3, 2, 8, 1, 2], 2, 1, 3, [9, 3]),  # [1, 2] beats the later [2]
    ([7, 7, 7], 4, 1, 2, [7, 7, 7, 7]),  # a match overlapping the suffix: the loop continues
    ([3, 8, 3, 8, 3], 3, 1, 4, [8, 3, 8]),
    ([1, 2, 3], 2, 1, 3, []),  # nothing recurs
    ([1, 2, 3, 1], 2, 2, 3, []),  # only a 1-gram recurs, and 2 is the minimum
    ([1, 2, 3, 1], 0, 1, 3, []),  # k = 0
    ([4], 3, 1, 3, []),
])
def test_propose_ngram(tokens, k, n_min, n_max, want):
    assert propose_ngram(tokens, k, n_min, n_max) == want


def test_propose_ngram_ignores_byte_matches_across_tokens():
    # Little-endian bytes of [256, 0] contain those of [1] at an odd offset: not a token match.
    assert propose_ngram([256, 0, 5, 1], 2, 1, 1) == []
    assert propose_ngram([256, 1, 5, 1], 2, 1, 1) == [5, 1]


@pytest.mark.parametrize("value, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown"),
    ("ngram", "speculative_config"),
])
def test_config_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(speculative_config=value)


def test_config_parse():
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert spec == SpeculativeConfig(3, prompt_lookup_max=5)
    assert SpeculativeConfig.parse(None) is None


# -- the scheduler ------------------------------------------------------------------------------
def model(context: list[int]) -> int:
    """Repeats the token 3 back, except at every 7th position (a glitch drafts cannot foresee)."""
    n = len(context)
    if n % 7 == 0:
        return (context[-1] * 3 + n) % (VOCAB - 1) + 1
    return context[-3]


class Runner(FakeRunner):
    """The scheduler harness's shadow pool (tests/scheduler_helpers.py); samples `model` over the
    context read back through the block table, after the last real token and after each draft."""

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.write(out)
        result = ModelOutput()
        for sr in out.scheduled:
            if not sr.sample:
                continue
            end = sr.start_pos + len(sr.token_ids)
            for j in range(sr.num_drafts + 1):
                token = SampledToken(model(self.context(sr, end - sr.num_drafts + j)), logprob=-float(j))
                if j == 0:
                    result.sampled[sr.request_id] = token
                else:
                    result.draft_sampled.setdefault(sr.request_id, []).append(token)
        return result


def reference(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    toks, out = list(prompt), []
    while True:
        t = model(toks)
        toks.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and (t in (params.stop_token_ids or [])
                                              or (not params.ignore_eos and t == EOS)):
            return out
        if len(out) >= params.max_tokens or len(toks) >= max_model_len:
            return out


def drive(cfg: SchedulerConfig, requests: list[Request]) -> tuple[Scheduler, list[SchedulerOutput]]:
    sched, runner = Scheduler(cfg), Runner(cfg)
    for r in requests:
        sched.add_request(r)
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        rows = sum(1 + s.num_drafts for s in out.scheduled if s.sample)
        assert rows <= cfg.max_num_seqs, "a step samples at most max_num_seqs rows"
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        steps.append(out)
        sched.update(out, runner.execute(out))
        assert len(steps) < 5000
    assert sched.kv.num_free_blocks == cfg.num_blocks, "every block back in the pool"
    return sched, steps


def requests(seed: int, n: int, **params) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = dict(max_tokens=rng.randint(5, 60), ignore_eos=True, temperature=0.0)
        p.update(params)
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 20))]
        out.append(Request(f"r{i}", prompt, SamplingParams(**p), float(i), eos_token_ids=(EOS,)))
    return out


BASE = dict(num_blocks=60, block_size=4, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96,
            enable_chunked_prefill=True)


@pytest.mark.parametrize("extra", [
    dict(),
    dict(enable_prefix_caching=True),
    dict(num_blocks=26),  # squeezed: drafts meet preemption
    dict(num_blocks=26, preemption_mode="swap", num_cpu_blocks=30),
])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_drafts_give_the_plain_outputs_in_fewer_steps(extra, k):
    cfg = dict(BASE, **extra)
    plain, plain_steps = drive(SchedulerConfig(**cfg), reqs := requests(k, 12))
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params, cfg["max_model_len"])
    spec_reqs = requests(k, 12)
    sched, steps = drive(SchedulerConfig(**cfg, speculative=SpeculativeConfig(k)), spec_reqs)
    for a, b in zip(reqs, spec_reqs):
        assert b.output_token_ids == a.output_token_ids, b.request_id
        assert b.status == a.status
    s = sched.stats()
    assert s.spec_num_accepted_tokens > 0 and s.spec_num_draft_tokens > s.spec_num_accepted_tokens
    assert 1 <= max(sr.num_drafts for out in steps for sr in out.scheduled) <= k  # k: see the one-request tests
    assert len(steps) < len(plain_steps)


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    cfg = SchedulerConfig(**BASE, speculative=SpeculativeConfig(5))
    prompt = [5, 6, 7] * 3  # the model continues 5 6 7 5 6 7 ...; 7 stops it
    for stop in ([7], None):
        params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=stop, min_tokens=4)
        req = Request("a", prompt, params, 0.0, eos_token_ids=(EOS,))
        sched, steps = drive(cfg, [req])
        assert req.output_token_ids == reference(prompt, params, cfg.max_model_len)
    assert req.finish_reason == "length" and len(req.output_token_ids) == 30


def test_drafts_only_for_greedy_requests_and_only_in_free_rows():
    cfg = SchedulerConfig(**dict(BASE, max_num_seqs=4), speculative=SpeculativeConfig(3))
    greedy = requests(1, 2)
    sampled = [Request(f"s{i}", [3, 4, 3, 4, 3, 4], SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
                       10.0 + i, eos_token_ids=(EOS,)) for i in range(2)]
    sched, steps = drive(cfg, greedy + sampled)
    for out in steps:
        for sr in out.scheduled:
            if sr.request_id.startswith("s"):
                assert sr.num_drafts == 0
        # 4 requests in a 4-row step leave no room for drafts
        if len(out.scheduled) == 4:
            assert all(sr.num_drafts == 0 for sr in out.scheduled)


def test_disable_by_batch_size():
    spec = SpeculativeConfig(3, disable_by_batch_size=2)
    sched, steps = drive(SchedulerConfig(**dict(BASE, max_num_seqs=8), speculative=spec), requests(2, 5))
    for out in steps:
        if any(sr.num_drafts for sr in out.scheduled):
            assert len(out.scheduled) <= 2
    assert sched.stats().spec_num_drafts > 0


def test_drafts_stop_at_max_tokens_and_max_model_len():
    cfg = SchedulerConfig(**dict(BASE, max_model_len=40), speculative=SpeculativeConfig(5))
    a = Request("a", [1, 2, 3] * 4, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), 0.0)
    b = Request("b", [4, 5, 6] * 10, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True), 1.0)
    sched, steps = drive(cfg, [a, b])
    assert len(a.output_token_ids) == 7 and a.finish_reason == "length"
    assert b.num_tokens == 40 and b.finish_reason == "length"
    for out in steps:
        for sr in out.scheduled:
            assert sr.start_pos + len(sr.token_ids) <= 40


def test_draft_rows_are_shared_among_the_decoding_requests():
    """A step's free sampler rows go to every decoding request in equal shares (rounded up, the first
    requests first), not all to the first few: 3 looping requests and 5 free rows draft 2, 2 and 1."""
    assert (draft_share(5, 3), draft_share(3, 2), draft_share(1, 1), draft_share(2, 4), draft_share(0, 3)) == (2, 2, 1, 1, 0)
    cfg = SchedulerConfig(**dict(BASE, max_num_seqs=8), speculative=SpeculativeConfig(5))
    reqs = [Request(f"r{i}", [5, 6, 7] * 3, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    float(i), eos_token_ids=(EOS,)) for i in range(3)]
    sched, steps = drive(cfg, reqs)
    shares = [[sr.num_drafts for sr in out.scheduled] for out in steps if len(out.scheduled) == 3]
    assert [2, 2, 1] in shares, shares
    for d in shares:  # a request that proposes fewer (near max_tokens) leaves its rows to the next
        assert all(d[i] <= draft_share(5 - sum(d[:i]), 3 - i) for i in range(3)), d
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params, cfg.max_model_len)
