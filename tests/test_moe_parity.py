"""MoE families against transformers: tiny random checkpoints saved by transformers' own classes
(bfloat16 weights, tests/moe_fixtures.py), greedy tokens equal to transformers' float32 ones, and
each token's logprob within 1e-4 of transformers' (tests/logprob_parity.py), with the exact float32
flags on one device, under TP 2 with and without --enable-expert-parallel and
under PP 2 (fake CPU devices, one subprocess: tests/moe_worker.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.logprob_parity import assert_logprobs_close
from tests.moe_fixtures import CHECKPOINTS, MAX_TOKENS, PROMPTS, engine_run, hf_reference, make_engine, save_checkpoint
from tests.moe_worker import SETTINGS

pytestmark = pytest.mark.warmup  # its engines hold 0 compilations after warm-up (tests/conftest.py)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]], list[list[float]]]]:
    """name -> (checkpoint, transformers' greedy tokens, their logprobs)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name in CHECKPOINTS:
        path = save_checkpoint(name, root / name)
        out[name] = (path, *hf_reference(path))
    return out


@pytest.fixture(scope="module")
def multi_device(checkpoints) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.moe_worker", *(str(p) for p, _, _ in checkpoints.values())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def engines(checkpoints) -> dict:
    return {}  # name -> the one-device engine (the HTTP test serves qwen3_moe's)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_one_device_greedy_equals_transformers(checkpoints, engines, name):
    path, reference, ref_logprobs = checkpoints[name]
    engine = engines[name] = make_engine(path)
    cfg = engine.model.config
    assert cfg.moe is not None and cfg.moe.num_experts == 8
    if name == "qwen3_moe":  # the features the checkpoint exists for survived config.json
        assert cfg.moe.dense_layers == (1,) and not cfg.moe.norm_topk_prob and cfg.qk_norm
    if name == "qwen2_moe":
        assert cfg.moe.shared_expert_intermediate_size == 48 and cfg.moe.norm_topk_prob and cfg.attention_bias
    tokens, logprobs = engine_run(engine)
    assert tokens == reference
    assert_logprobs_close(logprobs, ref_logprobs, what=name)
    assert engine.get_stats().num_compilations_after_warmup == 0


CASES = [f"{name}/tp{tp}/pp{pp}" + ("/ep" if ep else "") for name, s in SETTINGS.items() for tp, pp, ep in s]


@pytest.mark.multidevice
@pytest.mark.parametrize("case", CASES)
def test_parallel_greedy_equals_transformers(checkpoints, multi_device, case):
    r = multi_device[case]
    _, reference, ref_logprobs = checkpoints[case.split("/")[0]]
    assert r["tokens"] == reference
    assert_logprobs_close(r["logprobs"], ref_logprobs, what=case)
    assert r["compiles_after_warmup"] == 0
    sizes = set(r["expert_bytes"].values())
    if "tp2" in case:  # every device holds half of each stage's expert weights, split on E with EP
        assert len(sizes) <= 2 and len(r["expert_bytes"]) == (4 if "pp2" in case else 2)
        assert r["expert_spec"].startswith("(None, 'model'" if case.endswith("/ep") else "(None, None, 'model'")


def test_served_over_http_with_no_compilation_after_warmup(checkpoints, engines):
    """`jaxserve serve`'s app on a real uvicorn server in front of the Qwen3-MoE engine: text in (its
    word-level tokenizer), transformers' greedy tokens and their logprobs out, nothing compiled after warm-up."""
    import httpx

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import serve_in_thread

    path, reference, ref_logprobs = checkpoints["qwen3_moe"]
    engine = AsyncLLM(engines.pop("qwen3_moe", None) or make_engine(path))
    try:
        with serve_in_thread(build_app(engine)) as url:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            prompts = [" ".join(f"w{t}" for t in p) for p in PROMPTS]
            resp = httpx.post(f"{url}/v1/completions", timeout=300, json=dict(
                model=model, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, logprobs=0))
            assert resp.status_code == 200, resp.text
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
            assert [c["text"].split() for c in choices] == [[f"w{t}" for t in r] for r in reference]
            assert_logprobs_close([c["logprobs"]["token_logprobs"] for c in choices], ref_logprobs, what="HTTP")
            bad = httpx.post(f"{url}/v1/completions", timeout=30, json=dict(model=model, prompt="w1", max_tokens=-1))
            assert bad.status_code == 400 and "max_tokens" in bad.text
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert re.search(r"^jaxserve:xla_compilations_after_warmup_total(\{[^}]*\})? 0\.0$", metrics, re.M), metrics
        assert engine.get_stats().num_compilations_after_warmup == 0
    finally:
        engine.shutdown()


def test_cpu_default_keeps_bfloat16_experts_as_their_bits(checkpoints):
    """`--dtype auto` on a CPU with bfloat16 dots: the bfloat16 checkpoint's expert stacks stay
    bfloat16 (their bits, half float32's bytes; the other weights float32), and steps of float32
    dots (here every step: 16 tokens at most) read them as their exact float32 values: transformers'
    float32 greedy tokens and their logprobs."""
    from jaxserve.models.expert_weights import BF16_BITS, EXPERT_STACKS
    from jaxserve.worker import sizing

    if not sizing.cpu_has_bf16_dots():
        pytest.skip("this CPU has no bfloat16 dot instructions: the CPU default keeps float32 experts")
    path, reference, ref_logprobs = checkpoints["mixtral"]
    engine = make_engine(path, dtype="auto")
    try:
        cfg, layers = engine.model.config, engine.runner.params["layers"]
        assert engine.config.bf16_dots_from > 16
        assert engine.runner.params["embed"].dtype == layers["wq"].dtype == jnp.float32
        for name in EXPERT_STACKS:  # [L, E, N, K]: 3 layers x 8 experts of 32 x 64, 2 bytes each
            assert layers[name].dtype == BF16_BITS and layers[name].nbytes == cfg.num_layers * 8 * 32 * 64 * 2
        size = 3 * cfg.num_layers * 8 * 32 * 64 * 2 / 2**20
        assert f"MoE experts kept as the checkpoint's bfloat16: {size:.1f} MiB" in engine.startup_report()
        assert engine.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(engine.model.params))
        tokens, logprobs = engine_run(engine)
        assert tokens == reference
        assert_logprobs_close(logprobs, ref_logprobs, what="bfloat16 bits")
        assert engine.get_stats().num_compilations_after_warmup == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_loader_reads_bfloat16_experts_as_their_bits(checkpoints, name):
    """load_model(expert_bits=True), as the CPU default asks: the bfloat16 checkpoint's expert stacks
    arrive as their bits (read layer by layer, never float32 on the way; a dense layer's zeros
    among them), their values the float32 load's; every other leaf as the float32 load's."""
    from jaxserve.models.expert_weights import BF16_BITS, EXPERT_STACKS, widen
    from jaxserve.weights.loader import load_model

    path = checkpoints[name][0]
    full = load_model(str(path), "float32", progress=False).params
    bits = load_model(str(path), "float32", progress=False, expert_bits=True).params
    assert sorted(bits["layers"]) == sorted(full["layers"])
    for leaf, want in full["layers"].items():
        got = bits["layers"][leaf]
        if leaf in EXPERT_STACKS:
            assert got.dtype == BF16_BITS and got.nbytes * 2 == want.nbytes
            got = widen(got)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
