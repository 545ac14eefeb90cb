"""Weights in and out of a live engine (issue 48; jaxserve/engine/weight_sync.py, weights/hf_names.py).

The new weights change the outputs: a peft LoRA adapter merged into conftest's tiny random Llama by
`merge_and_unload()`. After update_weights the greedy tokens equal transformers' float32 tokens of the
merged model (and their logprobs within 1e-4), and equal a fresh engine built from the merged
directory, bitwise; the prompts fill a 16-token block, so a prefix cache kept across the update would
serve the old weights' KV and fail the comparison. A rejected update leaves every output as it was.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.worker_run import run_json_worker
from tests.logprob_parity import assert_logprobs_close, generated_logprobs, reference_logprobs

pytestmark = pytest.mark.slow

EXACT = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})
# enforce_eager: no warm-up over every bucket; the programs these runs use compile on first use, and
# the compilation counts are taken after that
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=32,
              enable_prefix_caching=True, enforce_eager=True, **EXACT)
# 20 and 17 tokens: each fills a block, which the prefix cache keeps (and must forget at an update)
PROMPTS = [[1, 50, 400, 3000, 77, 12, 9, 801, 5000, 33, 4, 61, 7, 900, 15, 2, 88, 640, 31, 10],
           [5, 6, 7, 8, 1000, 2000, 3000, 4000, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
NUM_TOKENS = 8


def _hf_refs(model) -> dict:
    import torch

    tokens = []
    with torch.no_grad():
        for p in PROMPTS:  # one at a time: no padding in the reference
            out = model.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long), pad_token_id=0)
            tokens.append(out[0, len(p):].tolist())
    return {"tokens": tokens, "logprobs": [reference_logprobs(model, p, t) for p, t in zip(PROMPTS, tokens)]}


@pytest.fixture(scope="module")
def dirs(tiny_llama_dir, tmp_path_factory) -> dict:
    """The base and merged directories, transformers' float32 references for both, and a directory of
    another config (hidden 32) for the refusals."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None  # always NUM_TOKENS tokens
    refs = {"base": _hf_refs(base)}
    torch.manual_seed(1)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: a random B so the merged model differs
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    merged = peft_model.merge_and_unload().eval()
    root = tmp_path_factory.mktemp("weight_sync")
    merged.save_pretrained(root / "merged")
    transformers.AutoTokenizer.from_pretrained(str(tiny_llama_dir)).save_pretrained(str(root / "merged"))
    refs["merged"] = _hf_refs(merged)
    assert refs["merged"]["tokens"] != refs["base"]["tokens"], "the adapter must change the greedy tokens"
    other = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(other).save_pretrained(root / "other")
    return {"base": tiny_llama_dir, "merged": root / "merged", "other": root / "other", "refs": refs}


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def llm(dirs):
    from jaxserve import LLM

    engine = LLM(str(dirs["base"]), progress=False, **ENGINE)
    yield engine
    engine.shutdown()


def _run(llm) -> tuple[list[list[int]], list[list[float]]]:
    from jaxserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [generated_logprobs(o.outputs[0]) for o in outs]


def _check(got: tuple, ref: dict, what: str) -> None:
    assert got[0] == ref["tokens"], what
    assert_logprobs_close(got[1], ref["logprobs"], what=what)


def test_get_weights_is_the_checkpoint_by_hf_name(llm, dirs):
    weights, on_disk = llm.get_weights(), _safetensors(dirs["base"])
    assert sorted(weights) == sorted(on_disk)
    for name, value in on_disk.items():
        np.testing.assert_array_equal(np.asarray(weights[name]), value, err_msg=name)
    assert weights["model.embed_tokens.weight"] is llm.engine_params()["embed"]  # no copy where the layout allows


def test_update_serves_the_merged_adapter_like_transformers(llm, dirs):
    _check(_run(llm), dirs["refs"]["base"], "base")  # also fills the prefix cache with the base's blocks
    merged, base = _safetensors(dirs["merged"]), _safetensors(dirs["base"])
    changed = {k: v for k, v in merged.items() if not np.array_equal(v, base[k])}
    assert 0 < len(changed) < len(merged)  # a subset: the adapter's projections only
    llm.update_weights(changed, version=1)
    assert llm.llm_engine.weights_version == 1
    got = _run(llm)
    _check(got, dirs["refs"]["merged"], "after update_weights")
    from jaxserve import LLM

    fresh = LLM(str(dirs["merged"]), progress=False, **ENGINE)
    try:
        assert _run(fresh) == got  # tokens and logprobs bitwise
    finally:
        fresh.shutdown()


def test_no_compilation_over_ten_updates(llm, dirs):
    from jaxserve.worker.programs import num_compilations

    trees = {k: _safetensors(dirs[k]) for k in ("base", "merged")}
    on_device = {k: {n: jnp.asarray(v) for n, v in t.items()} for k, t in trees.items()}
    # The engine skips warm-up (enforce_eager): its programs compile on first use. Two updates and runs
    # first: jax arrays' assembly programs compile once, and so does a whole prefill after an update
    # fed the sampler's ids (the prefix cache was emptied); then ten updates compile nothing.
    for kind in ("merged", "base"):
        llm.update_weights(on_device[kind])
        _check(_run(llm), dirs["refs"][kind], f"{kind} as jax arrays")
    before = num_compilations()
    for i in range(10):
        kind = ("merged", "base")[i % 2]
        llm.update_weights((on_device if i % 4 < 2 else trees)[kind], version=i)  # jax and numpy
        if i in (0, 9):
            _check(_run(llm), dirs["refs"][kind], f"update {i}")
    assert num_compilations() - before == 0


@pytest.mark.parametrize("case", ["shape", "unknown", "nan", "int", "tree"])
def test_rejected_update_leaves_outputs_exactly(llm, dirs, case):
    before = _run(llm)
    merged = _safetensors(dirs["merged"])
    name = "model.layers.1.mlp.down_proj.weight"
    bad = {k: jnp.asarray(v) for k, v in merged.items()}  # valid everywhere else: nothing may land
    if case == "shape":
        bad[name] = bad[name].T
    elif case == "unknown":
        name = "model.layers.2.mlp.down_proj.weight"
        bad[name] = bad["model.layers.1.mlp.down_proj.weight"]
    elif case == "nan":
        bad[name] = bad[name].at[3, 5].set(jnp.nan)
    elif case == "int":
        bad[name] = bad[name].astype(jnp.int32)
    else:  # engine_params()' tree with one non-finite layer: named by its HF name
        bad = jax.tree.map(lambda x: x, llm.engine_params())
        bad["layers"]["w_down"] = bad["layers"]["w_down"].at[1, 0, 0].set(jnp.inf)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        llm.update_weights(bad)
    assert _run(llm) == before


def test_engine_tree_is_adopted_without_a_copy(llm, dirs):
    params = jax.tree.map(lambda x: x, llm.engine_params())  # the same arrays, a new tree
    llm.update_weights(params)
    after = llm.engine_params()
    assert all(a is b for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params)))
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)  # another float dtype: cast back
    before = _run(llm)
    llm.update_weights(half)
    assert llm.engine_params()["embed"].dtype == jnp.float32
    llm.update_weights(params)
    assert _run(llm) == before


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_quantized_engine_requantizes_what_it_receives(dirs, quantization):
    """An int8 / fp8 engine updated with the merged weights holds exactly what one built from them does."""
    from jaxserve import LLM

    kw = dict(ENGINE, quantization=quantization)  # no step runs: nothing compiles but the quantization
    updated, fresh = LLM(str(dirs["base"]), progress=False, **kw), LLM(str(dirs["merged"]), progress=False, **kw)
    try:
        updated.update_weights(_safetensors(dirs["merged"]))
        got, want = updated.engine_params(), fresh.engine_params()
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        if quantization == "int8":
            with pytest.raises(ValueError, match="takes every parameter at once"):
                updated.update_weights({"model.norm.weight": np.ones(64, np.float32)})
    finally:
        updated.shutdown()
        fresh.shutdown()


@pytest.mark.multidevice
def test_tensor_parallel_update_from_unsharded_weights(dirs, tmp_path):
    """TP 2 (2 fake CPU devices, a subprocess): the merged weights given unsharded (numpy, and jax
    arrays on one device) are split onto the engine's shardings; tokens as transformers'."""
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"base": str(dirs["base"]), "merged": str(dirs["merged"]), "refs": dirs["refs"],
                                "prompts": PROMPTS, "num_tokens": NUM_TOKENS}))
    result = run_json_worker("weight_sync_tp_worker", str(spec), devices=2)
    for kind in ("numpy", "jax"):
        assert result[kind]["tokens"] == dirs["refs"]["merged"]["tokens"], kind
        assert_logprobs_close(result[kind]["logprobs"], dirs["refs"]["merged"]["logprobs"], what=f"TP 2 {kind}")
    assert result["sharded_like_before"]
    assert result["compilations_after_updates"] == 0


def test_update_weights_from_disk_over_http(llm, dirs, monkeypatch):
    """POST /update_weights_from_disk on the real app (dev routes on): the served tokens become
    transformers' merged ones; another config or a bad path is a 400 saying why, old weights kept.
    (The module's engine, serving the base weights again, goes behind the server: the last test here.)"""
    import httpx

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import serve_in_thread

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # the dev routes, as vLLM's
    engine = AsyncLLM(llm.llm_engine)  # its thread owns the engine from here on

    def completions(url: str) -> list[list[str]]:  # each generated token's text, as logprobs.tokens gives it
        out = []
        for p in PROMPTS:
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": engine.model_name, "prompt": p, "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["logprobs"]["tokens"])
        return out

    def texts(kind: str) -> list[list[str]]:
        return [[engine.tokenizer.decode([t]) for t in seq] for seq in dirs["refs"][kind]["tokens"]]

    try:
        with serve_in_thread(build_app(engine)) as url:
            assert completions(url) == texts("base")
            for body, why in (({"model_path": str(dirs["other"])}, "hidden_size"),
                              ({"model_path": str(dirs["merged"] / "nowhere")}, "not a directory"),
                              ({}, "model_path")):
                r = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=120)
                assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
            assert completions(url) == texts("base")
            r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(dirs["merged"]),
                                                                   "version": "step-1"}, timeout=120)
            assert r.status_code == 200, r.text
            assert completions(url) == texts("merged")
            assert httpx.post(f"{url}/reset_prefix_cache", timeout=30).status_code == 200
    finally:
        engine.shutdown()
