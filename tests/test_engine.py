"""The engine on the real default model: continuous batching under a squeezed KV pool
(both preemption modes, chunked prefill and prefix caching on and off) must give exactly
transformers' greedy tokens, leave the pool empty, and compile nothing after warm-up."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.warmup  # its engines hold 0 compilations after warm-up (tests/conftest.py)
# 64 requests: the 8 reference prompts x 8 output lengths between 6 and 48 tokens.
MAX_TOKENS = [6, 48, 12, 40, 20, 33, 9, 27]
REQUESTS = [(p, MAX_TOKENS[(i + j) % 8]) for j in range(8) for i, p in enumerate(PROMPTS)]

CONFIGS = {
    "recompute": dict(preemption_mode="recompute", enable_chunked_prefill=False, enable_prefix_caching=False,
                      max_num_batched_tokens=128),
    "swap+chunked+prefix": dict(preemption_mode="swap", swap_space=0.05, enable_chunked_prefill=True,
                                enable_prefix_caching=True, max_num_batched_tokens=16),
    # chunked prefill and prefix caching under recompute preemption, with n-gram drafts in the
    # batch's tail (16 running of 64: no free sampler rows, so no drafts, until the last requests)
    "recompute+chunked+prefix+ngram": dict(preemption_mode="recompute", enable_chunked_prefill=True,
                                           enable_prefix_caching=True, max_num_batched_tokens=16,
                                           speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
}
# The exact float32 configuration (a float32 KV pool: the CPU default is bfloat16), held to transformers.
COMMON = dict(max_model_len=128, block_size=8, num_gpu_blocks_override=40, max_num_seqs=16, dtype="float32",
              kv_cache_dtype="auto")


def _llm(jax_default_model, **kw) -> LLM:
    return LLM(jax_default_model, progress=False, **kw)  # reuse the session's loaded weights


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_64_requests_match_transformers_greedy(name, jax_default_model, hf_greedy):
    llm = _llm(jax_default_model, **COMMON, **CONFIGS[name])
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in REQUESTS]
    outs = llm.generate([p for p, _ in REQUESTS], params, use_tqdm=False)
    for (prompt, m), out in zip(REQUESTS, outs):
        ref = hf_greedy[prompt][1][:m]
        assert out.outputs[0].token_ids == ref, f"{name}: {prompt!r} (max_tokens={m}) diverged"
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == hf_greedy[prompt][0]
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the squeezed pool should force preemption"
    if CONFIGS[name]["enable_prefix_caching"]:
        assert stats.prefix_cache_hits > 0
    if CONFIGS[name].get("speculative_config"):
        assert stats.spec_num_accepted_tokens > 0
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_swapped == 0 and stats.cpu_cache_usage == 0.0
    assert engine.scheduler.kv.num_free_blocks == engine.num_gpu_blocks
    assert stats.num_compilations_after_warmup == 0, "serving compiled a new XLA program"


def test_seeded_sampling_is_batch_independent(jax_default_model):
    llm = _llm(jax_default_model, **COMMON, max_num_batched_tokens=128)
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=20) for s in range(6)]
    batch = llm.generate(PROMPTS[1:4] + [PROMPTS[0]] + PROMPTS[4:7], others[:3] + [sp] + others[3:],
                         use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    unseeded = llm.generate([PROMPTS[0]] * 2, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids
    assert llm.llm_engine.get_stats().num_compilations_after_warmup == 0


def test_n_best_of_stop_and_logprobs(jax_default_model):
    llm = _llm(jax_default_model, **COMMON, max_num_batched_tokens=128)
    out = llm.generate(PROMPTS[2], SamplingParams(n=3, best_of=4, temperature=1.0, seed=7, max_tokens=12,
                                                  logprobs=3), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    cums = [o.cumulative_logprob for o in out.outputs]
    assert cums == sorted(cums, reverse=True)
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for tok, entry in zip(o.token_ids, o.logprobs):
            assert tok in entry and len(entry) >= 3
    # A stop string cuts the text and ends the request.
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    text = greedy.outputs[0].text
    stop = text.strip().split()[1]
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)[0]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert llm.llm_engine.scheduler.kv.num_free_blocks == llm.llm_engine.num_gpu_blocks


def test_ngram_speculation_keeps_tokens_logprobs_and_stop_strings(jax_default_model):
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    plain = _llm(jax_default_model, **COMMON, max_num_batched_tokens=128)
    fast = _llm(jax_default_model, **COMMON, max_num_batched_tokens=128, speculative_config=spec)
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True)
    want, got = (llm.generate(prompts, params, use_tqdm=False) for llm in (plain, fast))
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and g.text == w.text
        assert len(g.logprobs) == len(g.token_ids)
        for we, ge in zip(w.logprobs, g.logprobs):
            assert list(ge) == list(we)
            assert [e.logprob for e in ge.values()] == pytest.approx([e.logprob for e in we.values()], abs=1e-4)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    stats = fast.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0, "no draft was accepted: nothing was tested"
    # A stop string met inside a step's accepted drafts: the text ends before it, no token after it.
    text = want[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = [llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
           for llm in (plain, fast)]
    assert cut[1].outputs[0].text == cut[0].outputs[0].text == text[: text.index(stop)]
    assert cut[1].outputs[0].token_ids == cut[0].outputs[0].token_ids
    assert cut[1].outputs[0].finish_reason == "stop" and cut[1].outputs[0].stop_reason == stop
    assert fast.llm_engine.scheduler.kv.num_free_blocks == fast.llm_engine.num_gpu_blocks
    assert stats.num_compilations_after_warmup == 0


def test_bad_requests_are_refused_and_leave_the_engine_clean(jax_default_model):
    llm = _llm(jax_default_model, **COMMON, max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": list(range(200))}, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": [10**7]}, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    ok = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 4
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_logprobs_match_transformers(jax_default_model, hf_default_model):
    import numpy as np
    import torch

    llm = _llm(jax_default_model, **COMMON, max_num_batched_tokens=16, enable_chunked_prefill=True,
               enable_prefix_caching=True)
    prompt = PROMPTS[7] + " " + PROMPTS[2]  # longer than one 16-token chunk: spans two steps
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert len(ids) > 16 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert ids[pos] in entry and len(entry) >= 2
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]]) < 1e-3
        best = int(np.argmax(ref[pos - 1]))
        assert best in entry and entry[best].rank == 1
    assert llm.llm_engine.get_stats().num_compilations_after_warmup == 0


def test_beam_search(jax_default_model):
    llm = _llm(jax_default_model, **COMMON, max_num_batched_tokens=128, enable_prefix_caching=True)
    prompt = PROMPTS[3]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    one = llm.generate(prompt, SamplingParams(use_beam_search=True, beam_width=1, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert one.outputs[0].token_ids == greedy.outputs[0].token_ids
    sp = SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=8, ignore_eos=True, length_penalty=0.0)
    beams = llm.generate(prompt, sp, use_tqdm=False)[0].outputs
    assert len(beams) == 3 and len({tuple(b.token_ids) for b in beams}) == 3
    cums = [b.cumulative_logprob for b in beams]
    assert cums == sorted(cums, reverse=True)
    # Each beam's score is the model's own logprob of its tokens, re-scored teacher-forced.
    ids = greedy.prompt_token_ids
    for b in beams:
        full = llm.generate({"prompt_token_ids": ids + b.token_ids},
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        rescored = sum(full.prompt_logprobs[len(ids) + j][t].logprob for j, t in enumerate(b.token_ids))
        assert abs(rescored - b.cumulative_logprob) < 1e-3
    assert llm.llm_engine.scheduler.kv.usage == 0.0
    assert llm.llm_engine.get_stats().num_compilations_after_warmup == 0
