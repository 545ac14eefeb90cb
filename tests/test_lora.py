"""Multi-LoRA on the default model (SmolLM2-135M) against transformers + peft in float32.

Adapters are made by peft (random B, several ranks and target sets, one with rslora) and
saved with save_pretrained; jaxserve's greedy tokens must equal peft's, and each token's logprob
be within 1e-4 of peft's float32 one (tests/logprob_parity.py), each adapter alone
and all mixed in one batch with base-model requests, with more adapters in flight than
--max-loras (and than --max-cpu-loras), offline and over HTTP (a real uvicorn server and the
openai client), with runtime load / use / unload. One engine for the module; its step
compiles nothing after warm-up whatever the adapters do. TP 2: tests/test_lora_tp.py.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from tests.worker_run import run_json_worker
from tests.conftest import ENGINE
from tests.logprob_parity import assert_logprobs_close, generated_logprobs
from tests.lora_helpers import ADAPTERS, NUM_TOKENS, make_adapters

pytestmark = pytest.mark.warmup  # its engines hold 0 compilations after warm-up (tests/conftest.py)
# the exact float32 configuration (conftest's ENGINE, no n-gram drafts), 3 slots of rank 16, 3 host copies
LORA_ENGINE = dict(ENGINE, speculative_config={}, enable_lora=True, max_loras=3, max_lora_rank=16, max_cpu_loras=3)
# ignore_eos: peft's reference generates past EOS (conftest's hf_default_model), always NUM_TOKENS tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def refs(hf_default_model, hf_default_tokenizer, tmp_path_factory) -> dict:
    return make_adapters(hf_default_model, hf_default_tokenizer, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def llm(jax_default_model):
    return LLM(jax_default_model, progress=False, **LORA_ENGINE)


def _lora(refs: dict, name: str) -> LoRARequest:
    return LoRARequest(name, IDS[name], refs[name]["path"])


def _prompts(refs: dict) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in refs["prompt_ids"]]


def _compilations_after_warmup(llm) -> int:
    return llm.llm_engine.get_stats().num_compilations_after_warmup


def test_every_adapter_changes_the_output(refs):
    for name in ADAPTERS:
        assert refs[name]["tokens"] != refs["base"], name


def _logprobs(outs) -> list[list[float]]:
    return [generated_logprobs(o.outputs[0]) for o in outs]


def test_each_adapter_alone_matches_peft(llm, refs):
    outs = llm.generate(_prompts(refs), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs["base"]
    assert_logprobs_close(_logprobs(outs), refs["base_logprobs"], what="base")
    for name in ADAPTERS:
        outs = llm.generate(_prompts(refs), GREEDY, use_tqdm=False, lora_request=_lora(refs, name))
        assert [o.outputs[0].token_ids for o in outs] == refs[name]["tokens"], name
        assert_logprobs_close(_logprobs(outs), refs[name]["logprobs"], what=name)
    assert _compilations_after_warmup(llm) == 0


@pytest.mark.parametrize("names", [["qv8", "mlp16rs", "all4"], list(ADAPTERS)], ids=["max_loras", "more"])
def test_mixed_batch_with_base_requests_matches_peft(llm, refs, names):
    """Adapters and the base model in one generate call; "more": 4 adapters over 3 slots and 3 host
    copies, so requests wait for a slot and an evicted adapter is read again."""
    prompts, loras, want, want_logprobs = [], [], [], []
    for name in [None] + names:
        ref = {"tokens": refs["base"], "logprobs": refs["base_logprobs"]} if name is None else refs[name]
        for p, ids, lps in zip(_prompts(refs), ref["tokens"], ref["logprobs"]):
            prompts.append(p)
            loras.append(None if name is None else _lora(refs, name))
            want.append(ids)
            want_logprobs.append(lps)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert_logprobs_close(_logprobs(outs), want_logprobs, what="mixed batch")
    assert _compilations_after_warmup(llm) == 0


def _copy_with(refs: dict, tmp_path, name: str, **changes):
    path = tmp_path / name
    shutil.copytree(refs["qv8"]["path"], path)
    conf = json.loads((path / "adapter_config.json").read_text())
    conf.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return str(path)


def test_unsupported_adapters_are_refused_naming_the_field(llm, refs, tmp_path):
    (tmp_path / "empty").mkdir()
    cases = [(_copy_with(refs, tmp_path, "dora", use_dora=True), "use_dora"),
             (_copy_with(refs, tmp_path, "mts", modules_to_save=["lm_head"]), "modules_to_save"),
             (_copy_with(refs, tmp_path, "r32", r=32), "r: .*--max-lora-rank"),
             (_copy_with(refs, tmp_path, "emb", target_modules=["embed_tokens"]), "target_modules"),
             (str(tmp_path / "missing"), "lora_path: .*does not exist"),
             (str(tmp_path / "empty"), "lora_path: .*not a PEFT adapter")]
    for k, (path, field) in enumerate(cases):
        with pytest.raises(ValueError, match=f"^{field}"):
            llm.generate(_prompts(refs)[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 50 + k, path))
    llm.generate(_prompts(refs)[:1], GREEDY, use_tqdm=False, lora_request=_lora(refs, "qv8"))  # its id known,
    with pytest.raises(ValueError, match="^lora_int_id"):  # then one id, two adapters (alone as in the suite)
        llm.generate(_prompts(refs)[:1], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("other", IDS["qv8"], refs["mlp16rs"]["path"]))
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was left half-added


# ---- over HTTP (the engine thread owns the engine from here on) -------------------------------------
@pytest.fixture(scope="module")
def server(llm, refs):
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app
    from jaxserve.entrypoints.openai.serving_lora import register_lora_modules
    from tests.fake_engine import serve_in_thread

    engine = AsyncLLM(llm.llm_engine)
    register_lora_modules(engine, tuple(f"{n}={refs[n]['path']}" for n in ("qv8", "mlp16rs", "all4")))
    old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        app = build_app(engine)
    finally:
        if old is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old
    try:
        with serve_in_thread(app) as url:
            yield url, engine
    finally:
        engine.shutdown()


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _complete(url: str, model: str, ids: list[int]) -> str:
    r = _client(url).completions.create(model=model, prompt=ids, max_tokens=NUM_TOKENS, temperature=0.0,
                                        extra_body={"ignore_eos": True})  # as GREEDY
    return r.choices[0].text


def test_http_adapters_and_base_mixed(server, refs, hf_default_tokenizer):
    url, engine = server
    base = engine.model_name
    jobs = [(name, ids, want) for name in [base, "qv8", "mlp16rs", "all4"]
            for ids, want in zip(refs["prompt_ids"], refs["base"] if name == base else refs[name]["tokens"])]
    with ThreadPoolExecutor(len(jobs)) as pool:  # all in flight together
        texts = list(pool.map(lambda j: _complete(url, j[0], j[1]), jobs))
    assert texts == [hf_default_tokenizer.decode(want) for _, _, want in jobs]
    models = {m.id: m for m in _client(url).models.list().data}
    assert models["qv8"].parent == engine.model_name and models["qv8"].root == refs["qv8"]["path"]
    assert set(models) == {engine.model_name, "qv8", "mlp16rs", "all4"}
    metrics = httpx.get(f"{url}/metrics").text
    assert 'vllm:lora_requests_info{max_lora="3",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    assert engine.get_stats().num_compilations_after_warmup == 0


def test_http_unknown_model_is_404(server):
    url, _ = server
    with pytest.raises(openai.NotFoundError) as err:
        _complete(url, "nope", [1, 2, 3])
    assert err.value.body["message"] == "The model `nope` does not exist."


def test_http_runtime_load_use_unload(server, refs, hf_default_tokenizer, tmp_path):
    url, engine = server
    load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "ko8", "lora_path": refs["ko8"]["path"]})
    assert load.status_code == 200, load.text
    assert "ko8" in {m.id for m in _client(url).models.list().data}
    texts = [_complete(url, "ko8", ids) for ids in refs["prompt_ids"]]
    assert texts == [hf_default_tokenizer.decode(t) for t in refs["ko8"]["tokens"]]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "ko8", "lora_path": refs["ko8"]["path"]})
    assert again.status_code == 400
    bad = httpx.post(f"{url}/v1/load_lora_adapter",
                     json={"lora_name": "dora", "lora_path": _copy_with(refs, tmp_path, "dora", use_dora=True)})
    assert bad.status_code == 400 and "use_dora" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ko8"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(url, "ko8", refs["prompt_ids"][0])
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ko8"}).status_code == 404
    # the server stays up: the base model and the other adapters still answer, rightly
    assert _complete(url, "qv8", refs["prompt_ids"][0]) == hf_default_tokenizer.decode(refs["qv8"]["tokens"][0])
    assert httpx.get(f"{url}/health").status_code == 200
    assert engine.get_stats().num_compilations_after_warmup == 0


def test_http_twenty_concurrent_loads_get_distinct_working_adapters(server, refs, hf_default_tokenizer):
    """20 /v1/load_lora_adapter calls at once, distinct names over the 4 adapters' paths: each a 200
    under its own id (as vLLM, --max-loras and --max-cpu-loras bound a step's slots and the host copies,
    not the names served), and each name then answers with its adapter's peft tokens, 20 requests at
    once over 3 slots; two loads of one name at once: one 200, one 400."""
    import asyncio

    url, engine = server
    names = [f"c{k}" for k in range(20)]
    adapter = {n: list(ADAPTERS)[k % len(ADAPTERS)] for k, n in enumerate(names)}

    async def load_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            calls = [client.post("/v1/load_lora_adapter", json={"lora_name": n, "lora_path": refs[adapter[n]]["path"]})
                     for n in names]
            calls += [client.post("/v1/load_lora_adapter", json={"lora_name": "dup", "lora_path": refs["qv8"]["path"]})
                      for _ in range(2)]
            return list(await asyncio.gather(*calls))

    responses = asyncio.run(load_all())
    assert [r.status_code for r in responses[:20]] == [200] * 20, [r.text for r in responses[:20]]
    assert sorted(r.status_code for r in responses[20:]) == [200, 400]
    manager = engine.lora_manager
    ids = [manager.resolve(n).lora_int_id for n in names + ["dup", "qv8", "mlp16rs", "all4"]]
    assert len(set(ids)) == len(ids), ids

    def complete(k: int) -> str:
        r = _client(url).completions.create(model=names[k], prompt=refs["prompt_ids"][k % 3], max_tokens=2,
                                            temperature=0.0, extra_body={"ignore_eos": True})
        return r.choices[0].text

    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(complete, range(len(names))))
    assert texts == [hf_default_tokenizer.decode(refs[adapter[n]]["tokens"][k % 3][:2]) for k, n in enumerate(names)]
    for n in names + ["dup"]:
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": n}).status_code == 200
    assert engine.get_stats().num_compilations_after_warmup == 0


def test_adapter_saved_in_bfloat16_or_float16_reads_as_safetensors_torch_does(refs, jax_default_model, tmp_path):
    """An adapter saved in bfloat16 / float16: A and B (B times the scaling) as torch reads the file."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from jaxserve.lora.peft import load_adapter

    src = refs["all4"]["path"]
    key = "base_model.model.model.layers.3.mlp.down_proj.lora_{}.weight"
    for dtype in (torch.bfloat16, torch.float16):
        path = tmp_path / str(dtype).removeprefix("torch.")
        shutil.copytree(src, path)
        tensors = {k: v.to(dtype) for k, v in load_file(f"{src}/adapter_model.safetensors").items()}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        w = load_adapter(path, jax_default_model.config, 16)
        a, b = w.modules["w_down"]
        assert np.array_equal(a[3], tensors[key.format("A")].float().numpy().T)
        assert np.array_equal(b[3], tensors[key.format("B")].float().numpy().T * w.scaling)
        assert not np.array_equal(b[3], load_adapter(src, jax_default_model.config, 16).modules["w_down"][1][3])


def test_lora_on_a_mixture_of_experts_is_refused_before_loading(tmp_path):
    """A MoE checkpoint with --enable-lora: refused from its config.json alone (the directory holds
    no weights, so an attempt to load them would fail otherwise), with the field named."""
    import transformers

    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine
    from tests.moe_fixtures import CHECKPOINTS, COMMON

    cls_name, extra = CHECKPOINTS["qwen3_moe"]
    getattr(transformers, cls_name)(**COMMON, **extra, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^enable_lora: .*Qwen3MoeForCausalLM is a mixture of experts"):
        LLMEngine(EngineArgs(model=str(tmp_path), enable_lora=True), progress=False)


@pytest.mark.multidevice
def test_tensor_parallel_2_matches_peft(refs, tmp_path):
    """TP 2 on 2 fake CPU devices (a subprocess: the device count is fixed at start-up). SmolLM2's
    9 heads do not split over 2, so attention and its adapters stay replicated while the MLP and its
    adapters (gate/up: B split on out; down: A split on in) are split."""
    refs_path = tmp_path / "refs.json"
    refs_path.write_text(json.dumps(refs))
    result = run_json_worker("lora_tp_worker", str(refs_path), devices=2)
    want = {f"base/{i}": t for i, t in enumerate(refs["base"])}
    want.update({f"{n}/{i}": t for n in ADAPTERS for i, t in enumerate(refs[n]["tokens"])})
    assert result["tokens"] == want
    want_logprobs = {f"base/{i}": lp for i, lp in enumerate(refs["base_logprobs"])}
    want_logprobs.update({f"{n}/{i}": lp for n in ADAPTERS for i, lp in enumerate(refs[n]["logprobs"])})
    assert_logprobs_close([result["logprobs"][k] for k in want], [want_logprobs[k] for k in want], what="TP 2")
    assert result["compilations_after_warmup"] == 0
