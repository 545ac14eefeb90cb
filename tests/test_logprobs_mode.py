"""Token ids and logprobs out for RL rollouts (issue 48): vLLM's --logprobs-mode against transformers'
float32 logits and vLLM's documented processing, --head-dtype float32 against the float32 reference,
--batch-invariant bitwise alone and in a batch of 64 (and the default mode shown not to be), and
return_tokens_as_token_ids over HTTP.

One tiny random Llama (bfloat16 weights, 4096 words: the vocabulary is one of the sampler's slices,
so its sliced greedy head runs) serves every test; each engine starts with enforce_eager (only the
programs a test runs compile).
"""

from __future__ import annotations

import functools

import httpx
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.config import EngineConfig
from jaxserve.worker import sizing
from tests.logprob_parity import LOGPROB_TOL, assert_logprobs_close, generated_logprobs, reference_logprobs
from tests.moe_fixtures import save_model

EXACT = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})
SMALL = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, num_gpu_blocks_override=64,
             compilation_cache_dir="", enforce_eager=True, progress=False)
PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 250, 11, 64, 9, 30, 2, 77, 18, 100, 6, 41], [8, 4000, 12], [200, 3, 77, 9, 64]]
MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    return save_model(cfg, tmp_path_factory.mktemp("rl_llama"))


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def hf_logits(hf, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits [len(tokens), V]: those that chose each generated token."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt + tokens])).logits[0].double().numpy()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def documented(logits: np.ndarray, mode: str, temperature: float, top_k: int) -> np.ndarray:
    """vLLM's logprobs_mode from raw logits [N, V]: raw_* the logits, processed_* / temperature with
    everything below the k-th largest at -inf (greedy rows: not scaled or filtered); *_logprobs
    log-softmaxed."""
    values = logits
    if mode.startswith("processed") and temperature > 0:
        kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
        values = np.where(logits >= kth, logits / temperature, -np.inf)
    if mode.endswith("logprobs"):
        top = values.max(-1, keepdims=True)
        values = values - top - np.log(np.exp(values - top).sum(-1, keepdims=True))
    return values


# ---- one engine for the modes, the head and the default mode's batch dependence --------------------
@pytest.fixture(scope="module")
def llm(ckpt):
    """--dtype auto (float32 weights) on a CPU with bfloat16 dot instructions (Zen 4, Sapphire Rapids;
    simulated here by its detection): the LM head's vocabulary slices run as bfloat16 dots unless
    --head-dtype float32; every step is under 64 tokens, so the body stays float32 (exact)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizing, "cpu_has_bf16_dots", lambda: True)
        llm = LLM(str(ckpt), logprobs_mode="processed_logprobs", head_dtype="float32", **dict(EXACT, dtype="auto"),
                  **SMALL)
    runner = llm.llm_engine.runner
    assert runner.rc.bf16_dots_from == 64 and runner.rc.head_float32 and runner.rc.logprobs_mode == "processed_logprobs"
    assert runner._sample_step.keywords["head_dots"] is False  # the float32 head takes no bfloat16 dots
    return llm


def _with(llm: LLM, **static) -> None:
    """The engine's sampler program with other static arguments (--logprobs-mode, the head's dtype): each
    is a static argument of that program, so this compiles the variant an engine started with those
    flags runs (one engine for every variant here; the flags' own plumbing is checked by `llm`)."""
    step = llm.llm_engine.runner._sample_step
    llm.llm_engine.runner._sample_step = functools.partial(step.func, **{**step.keywords, **static})


def test_logprobs_modes_against_transformers(llm, hf):
    # a sampled row (temperature 0.7, top_k 5) and a greedy one in one batch, with their top 3
    params = [SamplingParams(max_tokens=6, temperature=0.7, top_k=5, seed=3, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)]
    runs = {}
    for mode in ("processed_logprobs", "raw_logprobs", "raw_logits", "processed_logits"):  # the flag's first
        _with(llm, logprobs_mode=mode)
        runs[mode] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    _with(llm, logprobs_mode="raw_logprobs")
    for row, (prompt, sp) in enumerate(zip(PROMPTS[:2], params)):
        tokens = list(runs["raw_logprobs"][row].outputs[0].token_ids)
        logits = hf_logits(hf, prompt, tokens)
        if sp.temperature > 0:  # every sampled token lies in transformers' top 5
            assert all(t in np.argsort(-lg)[:5] for t, lg in zip(tokens, logits))
        for mode in MODES:
            out = runs[mode][row].outputs[0]
            assert list(out.token_ids) == tokens, f"{mode}: the mode changed what was sampled"
            want = documented(logits, mode, sp.temperature, sp.top_k)
            got = [entry[t].logprob for entry, t in zip(out.logprobs, tokens)]
            np.testing.assert_allclose(got, want[np.arange(len(tokens)), tokens], atol=LOGPROB_TOL, rtol=0,
                                       err_msg=f"{mode}, temperature {sp.temperature}")
            for entry, w in zip(out.logprobs, want):  # the top 3: ids, values and ranks of that mode
                top = sorted((e.rank, t, e.logprob) for t, e in entry.items() if e.rank <= 3)
                assert [t for _, t, _ in top] == list(np.argsort(-w, kind="stable")[:3]), mode
                np.testing.assert_allclose([v for _, _, v in top], np.sort(w)[::-1][:3], atol=LOGPROB_TOL, rtol=0)


def test_logprobs_mode_is_validated():
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineArgs(logprobs_mode="logits")
    with pytest.raises(ValueError, match="head_dtype"):
        EngineArgs(head_dtype="float16")


# ---- --head-dtype float32 -------------------------------------------------------------------------
def test_head_float32_matches_the_float32_forward(llm, hf):
    """The sampled tokens' logprobs within 1e-4 of transformers' float32 forward over the same sequences
    (the trainer's view) with --head-dtype float32; the bfloat16 head dots were ~1e-3 off."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    worst = {}
    for head_float32 in (False, True):
        _with(llm, head_float32=head_float32, head_dots=not head_float32)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        got = [generated_logprobs(o.outputs[0]) for o in outs]
        want = [reference_logprobs(hf, p, list(o.outputs[0].token_ids)) for p, o in zip(PROMPTS, outs)]
        worst[head_float32] = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
        if head_float32:
            assert_logprobs_close(got, want, what="--head-dtype float32")
    assert worst[False] > 10 * LOGPROB_TOL, f"the bfloat16 head dots were expected to differ: {worst}"


def test_head_float32_products_are_exact():
    """bfloat16 hidden states and weights (tied, untied, a vocabulary slice) give the float64 product
    of the same values to float32 rounding: the dot accumulates in float32 without rounding its inputs."""
    import jax.numpy as jnp

    from jaxserve.worker.lm_head import head_logits, head_slice_logits

    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((5, 64)) * 3, jnp.bfloat16)
    head = jnp.asarray(rng.standard_normal((64, 512)), jnp.bfloat16)
    want = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64)
    for params in ({"embed": head.T, "lm_head": head}, {"embed": head.T}):
        got = np.asarray(head_logits(params, hidden, True))
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        part = np.asarray(head_slice_logits(params, hidden, jnp.int32(128), 128, True))
        np.testing.assert_allclose(part, want[:, 128:256], rtol=0, atol=1e-4)
    capped = np.asarray(head_logits({"embed": head.T}, hidden, True, soft_cap=5.0))
    np.testing.assert_allclose(capped, np.tanh(want / 5.0) * 5.0, rtol=0, atol=1e-5)


# ---- --batch-invariant ----------------------------------------------------------------------------
def _alone_and_in_batch(llm: LLM, size: int) -> tuple[list[list[float]], list[list[float]]]:
    """Three requests' logprobs alone, and in a batch of `size` with chunked prefill (32-token steps):
    greedy and sampled rows mixed (a greedy request alone runs the sampler's all-greedy program)."""
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, 4096, int(rng.integers(3, 50)))] for _ in range(size)]
    params = [SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 1.0, seed=i, logprobs=0, ignore_eos=True)
              for i in range(size)]
    picked = (0, 1, 5)
    alone = [generated_logprobs(llm.generate([{"prompt_token_ids": prompts[i]}], params[i], use_tqdm=False)[0]
                                .outputs[0]) for i in picked]
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return alone, [generated_logprobs(batch[i].outputs[0]) for i in picked]


def test_batch_invariant_bitwise_alone_and_in_64(ckpt):
    llm = LLM(str(ckpt), batch_invariant=True, **EXACT, **dict(SMALL, max_num_seqs=64, num_gpu_blocks_override=256))
    alone, batched = _alone_and_in_batch(llm, 64)
    assert alone == batched, [max(abs(x - y) for x, y in zip(a, b)) for a, b in zip(alone, batched)]


def test_default_mode_is_not_batch_invariant(llm):
    """Without the flag the same check fails (the test above can): a prompt's chunking and its
    batch change the attention's summation order, by ~1e-6."""
    _with(llm, head_float32=True, head_dots=False, logprobs_mode="raw_logprobs")
    alone, batched = _alone_and_in_batch(llm, 8)
    assert alone != batched
    assert_logprobs_close(batched, alone, what="default mode, alone vs in a batch")


def test_batch_invariant_refusals_and_env(monkeypatch):
    for bad, name in ((dict(tensor_parallel_size=2), "tensor_parallel_size"),
                      (dict(quantization="int8"), "quantization"),
                      (dict(attention_backend="pallas"), "attention_backend"), (dict(enable_lora=True), "enable_lora")):
        with pytest.raises(ValueError, match=f"batch_invariant.*{name}"):
            EngineConfig.resolve(EngineArgs(batch_invariant=True, **bad), 2048, "cpu")
    assert not EngineConfig.resolve(EngineArgs(), 2048, "cpu").batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    config = EngineConfig.resolve(EngineArgs(), 2048, "cpu")
    assert config.batch_invariant and config.runner_config().batch_invariant
    with pytest.raises(ValueError, match="batch_invariant.*tensor_parallel_size"):
        EngineConfig.resolve(EngineArgs(tensor_parallel_size=2), 2048, "cpu")


# ---- token ids in and out over HTTP ---------------------------------------------------------------
def test_return_tokens_as_token_ids_over_http(llm):
    """A token-id prompt, logprobs=0 and return_tokens_as_token_ids through the real app: every token
    is "token_id:N" with the engine's own ids and logprobs (LLM.generate's, same seed)."""
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import serve_in_thread

    _with(llm, logprobs_mode="raw_logprobs")
    sp = SamplingParams(max_tokens=5, temperature=1.0, seed=11, logprobs=0, ignore_eos=True)
    want = llm.generate([{"prompt_token_ids": PROMPTS[2]}], sp, use_tqdm=False)[0].outputs[0]
    engine = AsyncLLM(llm.llm_engine)
    try:
        with serve_in_thread(build_app(engine)) as url:
            body = dict(model=str(llm.llm_engine.args.model), prompt=PROMPTS[2], max_tokens=5, temperature=1.0,
                        seed=11, logprobs=0, ignore_eos=True, return_tokens_as_token_ids=True)
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    finally:
        engine.shutdown()
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    np.testing.assert_allclose(lp["token_logprobs"], generated_logprobs(want), rtol=0, atol=1e-6)
    # OpenAI's legacy shape (vLLM's too): top_logprobs holds the chosen token beside the top N (here none)
    assert lp["top_logprobs"] == [{f"token_id:{t}": v} for t, v in zip(want.token_ids, lp["token_logprobs"])]
