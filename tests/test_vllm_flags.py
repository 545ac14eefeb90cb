"""vLLM's common flags with vLLM's meaning: --trust-remote-code, --tokenizer, --enforce-eager,
--max-logprobs, --generation-config (generation_config.json's sampling defaults, applied where a
request leaves a field unset), --served-model-name with several names, and LLM.beam_search with
vLLM's BeamSearchParams (held to transformers' beam search).

Engines here start with --enforce-eager (no warm-up; a few programs compile on demand), so each
costs seconds, not the minutes of a bucket warm-up on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest
from jax import monitoring

from jaxserve import LLM, BeamSearchParams, SamplingParams
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.generation_config import generation_defaults
from jaxserve.entrypoints.cli_args import add_serve_args, resolve
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.weights.loader import load_model
from tests.conftest import PROMPTS
from tests.fake_engine import FakeAsyncLLM, build_tokenizer, serve_in_thread

# What a model's authors recommend, as Qwen's and Llama's generation_config.json do.
GEN_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 7, "bos_token_id": 1, "eos_token_id": 2}
# vLLM's reading: the six sampling fields, max_new_tokens as max_tokens (do_sample and the ids ignored).
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 7}
EAGER = dict(max_model_len=64, block_size=16, num_gpu_blocks_override=24, max_num_seqs=4, dtype="float32",
             kv_cache_dtype="auto", max_num_batched_tokens=64, enforce_eager=True, progress=False)


def parse(argv: list[str]) -> EngineArgs:
    return resolve(add_serve_args(argparse.ArgumentParser(), positional_model=True).parse_args(argv)).engine


def test_flags_parse_with_vllm_meaning() -> None:
    e = parse(["m", "--trust-remote-code", "--tokenizer", "/tok", "--enforce-eager", "--max-logprobs", "5",
               "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}',
               "--served-model-name", "a", "b"])
    assert (e.trust_remote_code, e.tokenizer, e.enforce_eager, e.max_logprobs) == (True, "/tok", True, 5)
    assert (e.generation_config, e.override_generation_config) == ("vllm", {"temperature": 0.5})
    assert e.served_model_names == ("a", "b") and e.served_model_name == ("a", "b")
    d = parse([])  # vLLM's defaults
    assert (d.trust_remote_code, d.tokenizer, d.enforce_eager, d.max_logprobs, d.generation_config) == (
        False, None, False, 20, "auto")
    assert parse(["--served-model-name", "one"]).served_model_name == "one"
    with pytest.raises(ValueError, match="^max_logprobs"):
        EngineArgs(max_logprobs=21)


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, tiny_llama_dir: Path) -> Path:
    """The tiny Llama directory with a generation_config.json of sampling defaults (the shared one untouched)."""
    path = tmp_path_factory.mktemp("tiny_gen")
    for f in tiny_llama_dir.iterdir():
        if f.name != "generation_config.json":
            (path / f.name).symlink_to(f)
    (path / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return path


@pytest.fixture(scope="module")
def tiny_model(gen_dir: Path):
    return load_model(str(gen_dir), dtype="float32", progress=False)


def _spy(llm: LLM) -> list[SamplingParams]:
    """The SamplingParams each request reaches the engine with."""
    seen: list[SamplingParams] = []
    add = llm.llm_engine.add_request

    def add_request(request_id, prompt, params=None, *args, **kw):
        seen.append(params)
        return add(request_id, prompt, params, *args, **kw)

    llm.llm_engine.add_request = add_request
    return seen


def test_generation_config_modes(gen_dir: Path, tmp_path: Path, default_gguf: Path) -> None:
    assert generation_defaults("auto", gen_dir) == DEFAULTS
    assert generation_defaults("vllm", gen_dir) == {}
    assert generation_defaults("vllm", gen_dir, {"temperature": 0.5}) == {"temperature": 0.5}
    assert generation_defaults("auto", gen_dir, {"temperature": 0.5}) == {**DEFAULTS, "temperature": 0.5}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5}))
    assert generation_defaults(str(other), gen_dir) == {"temperature": 0.3, "top_k": 5}
    assert generation_defaults("auto", default_gguf) == {}  # a GGUF file has no generation config
    with pytest.raises(ValueError, match="^generation_config"):
        generation_defaults(str(tmp_path / "missing"), gen_dir)
    (other / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="^generation_config"):
        generation_defaults(str(other), gen_dir)


def test_generation_config_applies_offline(tiny_model, tiny_llama_dir: Path) -> None:
    """LLM.generate without SamplingParams uses get_default_sampling_params() (the file's values);
    a SamplingParams given is used as it is, so greedy by request stays greedy (transformers' tokens)."""
    import torch
    import transformers

    llm = LLM(tiny_model, **EAGER)
    seen = _spy(llm)
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    out = llm.generate(PROMPTS[0], use_tqdm=False)[0]
    params = seen[-1]
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
            params.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, 7)
    assert len(out.outputs[0].token_ids) == 7 or out.outputs[0].finish_reason == "stop"
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].repetition_penalty) == (0.0, 0, 1.0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    ids = greedy.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                          repetition_penalty=1.0, pad_token_id=0)[0, len(ids):].tolist()
    assert greedy.outputs[0].token_ids == ref
    vllm_defaults = LLM(tiny_model, generation_config="vllm", **EAGER)
    assert vllm_defaults.get_default_sampling_params() == SamplingParams()


class RecordingEngine(FakeAsyncLLM):
    """The fake engine with what the real AsyncLLM adds for the server: served names, defaults, max_logprobs."""

    def __init__(self) -> None:
        super().__init__(model_name="first")
        self.served_model_names = ("first", "second")
        self.default_sampling_params = dict(DEFAULTS)
        self.max_logprobs = 5
        self.seen: list[SamplingParams] = []

    def generate(self, prompt, sampling_params, request_id, **kw):
        self.seen.append(sampling_params)
        return super().generate(prompt, sampling_params, request_id, **kw)


def test_openai_requests_take_defaults_and_names() -> None:
    engine = RecordingEngine()
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    with serve_in_thread(build_app(engine)) as url, httpx.Client(base_url=url, timeout=10) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["first", "second"]
        r = http.post("/v1/chat/completions", json={**chat, "model": "second"})
        assert r.status_code == 200 and r.json()["model"] == "first"  # vLLM reports the first name
        p = engine.seen[-1]
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
            0.6, 0.9, 20, 0.05, 1.1, 7)
        http.post("/v1/chat/completions", json={**chat, "temperature": 0, "top_k": -1, "max_tokens": 12})
        p = engine.seen[-1]  # the request's own fields win, the others keep the defaults
        assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.0, 0, 0.9, 12)
        http.post("/v1/completions", json={"model": "first", "prompt": "hello"})
        assert (engine.seen[-1].temperature, engine.seen[-1].max_tokens) == (0.6, 16)  # completions' default 16
        assert http.post("/v1/completions", json={"model": "third", "prompt": "hello"}).status_code == 404
        http.post("/v1/chat/completions", json={**chat, "use_beam_search": True, "n": 2, "length_penalty": 0.5})
        p = engine.seen[-1]  # vLLM's chat beam search: n beams
        assert (p.use_beam_search, p.beam_width, p.n, p.length_penalty, p.temperature) == (True, 2, 2, 0.5, 1.0)
        r = http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = http.post("/v1/completions", json={"prompt": "hello", "logprobs": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        assert http.post("/v1/completions", json={"prompt": "hello", "logprobs": 5}).status_code == 200


def test_tokenizer_trust_remote_code_and_max_logprobs(tiny_model, tmp_path: Path, caplog) -> None:
    """--tokenizer DIR replaces the model's tokenizer and chat template; --trust-remote-code says once that
    nothing remote runs; --max-logprobs caps logprobs and prompt_logprobs."""
    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(str(tok_dir))
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.llm_engine"):
        llm = LLM(tiny_model, tokenizer=str(tok_dir), trust_remote_code=True, max_logprobs=2, **EAGER)
    assert sum("remote code" in r.getMessage() for r in caplog.records) == 1
    tok = llm.get_tokenizer()
    assert tok.encode("hello world", add_special_tokens=False) == [7, 8]
    chat = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        build_tokenizer().apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{name}: 3 requested"):
            llm.generate("hello", SamplingParams(max_tokens=1, **{name: 3}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    for bad in (tmp_path / "missing", tmp_path):  # not there; a directory without a tokenizer
        with pytest.raises(ValueError, match="^tokenizer"):
            LLM(tiny_model, tokenizer=str(bad), **EAGER)


@pytest.fixture(scope="module")
def eager_default(jax_default_model):
    """The default model, eager: nothing compiled at start-up (the test of warm-up counts them)."""
    from jaxserve.worker.model_runner import num_compilations

    before = num_compilations()
    llm = LLM(jax_default_model, max_model_len=128, block_size=8, num_gpu_blocks_override=40, max_num_seqs=16,
              dtype="float32", kv_cache_dtype="auto", max_num_batched_tokens=128, enable_prefix_caching=True,
              enforce_eager=True, progress=False)
    yield llm, num_compilations() - before
    llm.shutdown()


def test_enforce_eager_skips_warmup(eager_default, hf_greedy) -> None:
    """No bucket is compiled at start-up (a warmed engine compiles dozens); the first request compiles
    what it needs, counted as compilations after warm-up, and gives transformers' greedy tokens."""
    llm, startup_compiles = eager_default
    engine = llm.llm_engine
    assert startup_compiles <= 3  # the KV pool's allocation, not the model's or the sampler's programs
    assert "warm-up skipped (--enforce-eager)" in engine.startup_report()
    cache_hits = []  # a program another test compiled earlier is loaded from the persistent cache instead
    listener = lambda event, **kw: cache_hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None
    monitoring.register_event_listener(listener)
    try:
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        monitoring.unregister_event_listener(listener)
    assert out.outputs[0].token_ids == hf_greedy[PROMPTS[0]][1][:8]
    assert engine.get_stats().num_compilations_after_warmup + len(cache_hits) > 0


def test_beam_search_params_match_transformers(eager_default, hf_default_model) -> None:
    """vLLM's LLM.beam_search(prompts, BeamSearchParams) on the real model: the beam_width beams of
    transformers' beam search (length_penalty 0: ranked by cumulative logprob), as BeamSearchOutput."""
    import torch

    llm, _ = eager_default
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.0)
    (result,) = llm.beam_search([{"prompt": PROMPTS[3]}], params)
    ids = tok.encode(PROMPTS[3])
    with torch.no_grad():
        ref = hf_default_model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, do_sample=False,
                                        max_new_tokens=6, length_penalty=0.0, output_scores=True,
                                        return_dict_in_generate=True, pad_token_id=0)
    assert [s.tokens for s in result.sequences] == ref.sequences.tolist()  # the prompt included, as vLLM
    for seq, score in zip(result.sequences, ref.sequences_scores.tolist()):
        assert abs(seq.cum_logprob - score) < 1e-3
        assert seq.text == tok.decode(seq.tokens) and len(seq.logprobs) == 6
    old = llm.beam_search([PROMPTS[3]], SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=6,
                                                       ignore_eos=True, length_penalty=0.0))[0]
    assert [o.token_ids for o in old.outputs] == [s.tokens[len(ids):] for s in result.sequences]  # the old form
    with pytest.raises(ValueError, match="^beam_width"):
        llm.beam_search([PROMPTS[3]], BeamSearchParams(beam_width=11, max_tokens=2))
    # The server's path (AsyncLLM, behind use_beam_search on /v1/completions and /v1/chat/completions).
    server = AsyncLLM(llm.llm_engine)  # its thread owns the engine from here on: the fixture's last use

    async def run() -> RequestOutput:
        params = SamplingParams(use_beam_search=True, n=3, max_tokens=6, ignore_eos=True, length_penalty=0.0)
        return [out async for out in server.generate(ids, params, "beam")][-1]

    try:
        final = asyncio.run(run())
    finally:
        server.shutdown()
    assert [o.token_ids for o in final.outputs] == [s.tokens[len(ids):] for s in result.sequences]
