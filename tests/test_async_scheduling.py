"""Async scheduling (the host schedules step N+1 while the device runs step N; sampled ids stay on
the device and feed step N+1) must give exactly the synchronous engine's outputs, on the real
default model: seeded sampling, EOS, stop strings and stop token ids, max_tokens, min_tokens,
n > 1 / best_of, penalties, logprobs, n-gram drafts, preemption (both modes) and aborts; no token
past a request's end reaches a caller, the pool ends empty and nothing compiles after warm-up."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import PROMPTS

COMMON = dict(max_model_len=128, block_size=8, num_gpu_blocks_override=40, max_num_seqs=16, dtype="float32",
              enable_chunked_prefill=True, enable_prefix_caching=True, max_num_batched_tokens=16)
CONFIGS = {
    "recompute+ngram": dict(preemption_mode="recompute",
                            speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    "swap": dict(preemption_mode="swap", swap_space=0.05),
}
EOS = 2  # SmolLM2's <|im_end|>


def _params() -> list[SamplingParams]:
    """Every feature whose end the scheduler or the output processor decides."""
    return [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[" the", "\n"]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=25, logit_bias={EOS: 4.0}, min_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[13, 30]),
        SamplingParams(temperature=1.0, seed=11, n=2, best_of=3, max_tokens=14, logprobs=2),
        SamplingParams(temperature=0.7, seed=5, max_tokens=24, presence_penalty=0.8, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=9, max_tokens=33, ignore_eos=True),
    ]


def _outputs(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.request_id, [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                             None if c.logprobs is None else [sorted(d) for d in c.logprobs])
                            for c in o.outputs]) for o in outs]


@pytest.fixture(scope="module")
def workload() -> tuple[list[str], list[SamplingParams]]:
    params = _params()
    prompts = [PROMPTS[(i * 3) % len(PROMPTS)] for i in range(24)]
    # Last, so alone in the batch's tail, where sampler rows are free for drafts: long greedy
    # requests on a repetitive prompt, whose n-gram drafts the model accepts.
    tail = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return prompts + [PROMPTS[5]] * 2, [params[i % len(params)] for i in range(24)] + [tail] * 2


@pytest.mark.warmup  # holds 0 compilations after warm-up
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_async_outputs_equal_sync(name, jax_default_model, workload):
    prompts, params = workload
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(jax_default_model, progress=False, async_scheduling=async_scheduling, **COMMON, **CONFIGS[name])
        engine = llm.llm_engine
        assert engine.async_scheduling is async_scheduling
        results[async_scheduling] = _outputs(llm, prompts, params)
        stats = engine.get_stats()
        assert stats.num_preemptions > 0, "the squeezed pool should force preemption"
        assert stats.num_compilations_after_warmup == 0
        assert engine.scheduler.kv.num_free_blocks == engine.num_gpu_blocks and not engine.has_unfinished_requests()
        if "ngram" in name:
            assert stats.spec_num_accepted_tokens > 0
    assert results[True] == results[False]
    reasons = {c[2] for _, cs in results[True] for c in cs}
    assert {"stop", "length"} <= reasons


def test_streamed_steps_never_pass_the_end_and_aborts_stop_at_once(jax_default_model):
    """Step by step, as the server streams: outputs only grow, never past max_tokens, a stop
    string or an EOS, and an aborted request yields nothing after its abort."""
    llm = LLM(jax_default_model, progress=False, async_scheduling=True, **COMMON, **CONFIGS["swap"])
    engine = llm.llm_engine
    params = _params()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params[i])
    seen: dict[str, list[int]] = {}
    aborted_at: int | None = None
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if step == 6:
            aborted = engine.abort_request("r0")
            assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
            aborted_at = len(aborted[0].outputs[0].token_ids)
        for out in engine.step():
            assert out.request_id != "r0" or aborted_at is None, "an aborted request yielded an output"
            c = out.outputs[0]
            prev = seen.get(out.request_id, [])
            assert c.token_ids[:len(prev)] == prev, "outputs only grow"
            seen[out.request_id] = list(c.token_ids)
            p = params[int(out.request_id[1:])]
            assert len(c.token_ids) <= p.max_tokens
            if not p.ignore_eos and p.min_tokens <= len(c.token_ids) - 1:
                assert EOS not in c.token_ids[:-1], "a token after EOS"
        assert step < 500
    assert aborted_at is not None and engine.scheduler.kv.num_free_blocks == engine.num_gpu_blocks


def test_async_scheduling_flag_defaults_off_on_cpu(jax_default_model):
    from jaxserve.engine.args import EngineArgs

    assert EngineArgs().async_scheduling is None
    llm = LLM(jax_default_model, progress=False, **COMMON)
    assert llm.llm_engine.async_scheduling is False  # jax's CPU backend here
