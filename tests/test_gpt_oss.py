"""gpt-oss (GptOssForCausalLM) against transformers: a tiny random checkpoint saved by transformers'
own class in bfloat16 (tests/moe_fixtures.py GPT_OSS: 2 layers, a sliding layer of window 8 then a
full one, YaRN RoPE, attention sinks, biased router and experts), greedy tokens equal to
transformers' float32 ones and their logprobs within 1e-4 of transformers' (tests/logprob_parity.py), with the exact float32 flags on one device, TP 2, TP 2 with expert
parallelism and PP 2 (4 fake CPU devices, one subprocess: tests/moe_worker.py); the same model in
gpt-oss's MXFP4 hub layout, kept packed, against transformers' Mxfp4Config(dequantize=True)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.logprob_parity import assert_logprobs_close
from tests.moe_fixtures import engine_run, hf_greedy, hf_reference, make_engine, save_gpt_oss, save_mxfp4

ROOT = Path(__file__).resolve().parent.parent
# longer than the window (8) and than one step's token budget (16: chunked prefill), a short one, one token
PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 250, 11, 64, 9, 30, 2, 77, 18, 100, 6, 41, 12, 13, 14, 15], [8],
           [200, 3, 77, 9, 64]]
MAX_TOKENS = 8
# (tensor parallel, pipeline parallel, expert parallel): TP 2 splitting each expert's width, EP 2 with PP 2,
# and the packed MXFP4 experts split over TP 2 in both stages of PP 2 -- 3 engines in one subprocess
SETTINGS = {"gpt_oss": [[2, 1, False], [2, 2, True]], "gpt_oss_mxfp4": [[2, 2, False]]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[float]]]:
    """(the checkpoint, transformers' greedy tokens, their logprobs)."""
    path = save_gpt_oss(tmp_path_factory.mktemp("gpt") / "gpt_oss")
    return path, *hf_reference(path, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoint) -> tuple[Path, list[list[int]], list[list[float]]]:
    """The same model in gpt-oss's hub layout (MXFP4 experts), and transformers' tokens for it
    (Mxfp4Config(dequantize=True): the experts unpacked at load, as convert_moe_packed_tensors does)."""
    import transformers

    path = save_mxfp4(checkpoint[0], checkpoint[0].parent / "gpt_oss_mxfp4")
    return path, *hf_reference(path, PROMPTS, MAX_TOKENS, quantization_config=transformers.Mxfp4Config(dequantize=True))


@pytest.fixture(scope="module")
def multi_device(checkpoint, mxfp4_checkpoint) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    opts = json.dumps({"settings": SETTINGS, "prompts": PROMPTS})
    proc = subprocess.run([sys.executable, "-m", "tests.moe_worker", "--options", opts, str(checkpoint[0]),
                           str(mxfp4_checkpoint[0])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_config_reads_gpt_oss_fields(checkpoint):
    from jaxserve.weights.safetensors_dir import read_config

    cfg = read_config(checkpoint[0])
    assert cfg.family == "gpt_oss" and cfg.attention_bias and cfg.sliding_window == 8
    assert cfg.sliding_layers == (0,)  # layer_types: sliding, full
    assert cfg.rope_type == "yarn" and cfg.rope_scaling[:2] == (4.0, 64.0)
    assert cfg.rope_scaling[4] == 0.0 and abs(cfg.rope_scaling[5] - (0.1 * np.log(4.0) + 1)) < 1e-12
    m = cfg.moe
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.router) == (8, 2, 64, "topk_softmax")
    assert (m.swiglu_limit, m.swiglu_alpha) == (7.0, 1.702)


def test_yarn_frequencies_equal_transformers(checkpoint):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxserve.models.rope import attention_scale, inv_frequencies
    from jaxserve.weights.safetensors_dir import read_config

    cfg = read_config(checkpoint[0])
    for truncate in (False, True):
        hf = transformers.AutoConfig.from_pretrained(checkpoint[0])
        hf.rope_parameters["truncate"] = truncate
        inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
        ours = cfg if not truncate else type(cfg).from_dict(
            {**cfg.to_dict(), "rope_scaling": cfg.rope_scaling[:4] + (1.0,) + cfg.rope_scaling[5:]})
        np.testing.assert_allclose(inv_frequencies(ours).astype(np.float32), inv.numpy(), rtol=1e-6)
        assert abs(attention_scale(ours) - scale) < 1e-12


@pytest.mark.warmup  # holds 0 compilations after warm-up
def test_one_device_greedy_equals_transformers(checkpoint, tmp_path):
    path, reference, ref_logprobs = checkpoint
    # the window matters for these prompts: transformers with every layer full answers otherwise
    full = tmp_path / "full"
    shutil.copytree(path, full)
    hf = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**hf, "layer_types": ["full_attention"] * 2}))
    assert hf_greedy(full, PROMPTS[:1], MAX_TOKENS) != reference[:1]

    engine = make_engine(path)
    try:
        assert set(engine.model.params["layers"]) >= {"sinks", "sliding", "bo", "router_bias", "be_down"}
        np.testing.assert_array_equal(np.asarray(engine.model.params["layers"]["sliding"]), [1.0, 0.0])
        tokens, logprobs = engine_run(engine, PROMPTS, MAX_TOKENS)
        assert tokens == reference
        assert_logprobs_close(logprobs, ref_logprobs, what="gpt_oss")
        assert engine.get_stats().num_compilations_after_warmup == 0
    finally:
        engine.shutdown()


@pytest.mark.multidevice
@pytest.mark.parametrize("case", ["gpt_oss/tp2/pp1", "gpt_oss/tp2/pp2/ep", "gpt_oss_mxfp4/tp2/pp2"])
def test_parallel_greedy_equals_transformers(checkpoint, mxfp4_checkpoint, multi_device, case):
    r = multi_device[case]
    _, reference, ref_logprobs = mxfp4_checkpoint if "mxfp4" in case else checkpoint
    assert r["tokens"] == reference
    assert_logprobs_close(r["logprobs"], ref_logprobs, what=case)
    assert r["compiles_after_warmup"] == 0
    # every device holds half of its stage's experts: whole ones with EP (split on E), else half of each
    # one's width (I, the out axis of we_gate [L, E, I, H]; packed: of its blocks [L, E, N, K/32, 16])
    assert len(r["expert_bytes"]) == (4 if "pp2" in case else 2) and len(set(r["expert_bytes"].values())) == 1
    assert r["expert_spec"].startswith("(None, 'model'" if case.endswith("/ep") else "(None, None, 'model'")


def test_plan_sizes_gpt_oss_20b():
    """The registry gives `jaxserve plan` / sizing the family: gpt-oss-20b's shape (its hub config.json's
    fields, bf16 experts) counts OpenAI's model card's parameters, all in memory, half per device at TP 2."""
    from jaxserve.models.config import ModelConfig
    from jaxserve.plan.estimate import active_params, total_params
    from jaxserve.worker import sizing

    hf = dict(architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880, intermediate_size=2880,
              num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
              num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
              layer_types=["sliding_attention", "full_attention"] * 12, rope_theta=150000, swiglu_limit=7.0,
              rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                original_max_position_embeddings=4096),  # the hub file's older spelling
              quantization_config=dict(quant_method="mxfp4"))
    cfg = ModelConfig.from_hf(hf)
    assert cfg.sliding_layers == tuple(range(0, 24, 2)) and cfg.rope_theta == 150000
    assert cfg.rope_scaling == (32.0, 4096.0, 32.0, 1.0, 0.0, 0.1 * np.log(32.0) + 1)
    # OpenAI's card: 20.91 B total, 3.61 B active (its active count leaves out the input embedding)
    assert round(total_params(cfg) / 1e9, 2) == 20.91
    assert round((active_params(cfg) - cfg.vocab_size * cfg.hidden_size) / 1e9, 2) == 3.61
    one = sizing.weight_bytes_per_device(cfg, 2)
    assert abs(one - 2 * total_params(cfg)) < 1e6
    assert abs(sizing.weight_bytes_per_device(cfg, 2, 2) - one / 2) < one * 0.02
    # the hub's MXFP4 checkpoint: experts at 4.25 bits, the rest bf16 -- 13.8 GB as its files are
    assert round(sizing.weight_bytes_per_device(cfg, 2, quantization="mxfp4") / 1e9, 1) == 13.8


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_biased_clamped_experts_on_every_path(num_tokens):
    """gpt-oss's experts (biases, clamped SwiGLU) through moe.expert_swiglu's gather / sorted paths and
    the grouped path (the Pallas kernel in interpret mode) against numpy, ids past the experts
    (expert parallelism's other devices: output 0) included."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import moe
    from jaxserve.models.attention import PALLAS_INTERPRET
    from jaxserve.models.gpt_oss import ClampedSwiGLU

    rng = np.random.default_rng(num_tokens)
    w = lambda *s: rng.standard_normal(s).astype(np.float32) * 2  # noqa: E731  (large: the clamps bite)
    ws, bs = (w(8, 32, 64), w(8, 32, 64), w(8, 64, 32)), (w(8, 32), w(8, 32), w(8, 64))  # [E, out, in]
    ex = moe.Experts(*map(jnp.asarray, ws), *map(jnp.asarray, bs), ClampedSwiGLU(1.702, 7.0))
    x = rng.standard_normal((num_tokens, 64)).astype(np.float32)
    ids = rng.integers(0, 9, (num_tokens, 2)).astype(np.int32)  # 8: not computed
    want = np.zeros((num_tokens, 2, 64), np.float64)
    for t, j in np.ndindex(num_tokens, 2):
        e = ids[t, j]
        if e < 8:
            gate = np.minimum(ws[0][e] @ x[t] + bs[0][e], 7.0)
            up = np.clip(ws[1][e] @ x[t] + bs[1][e], -7.0, 7.0)
            sigmoid = 0.5 * (1 + np.tanh(0.5 * 1.702 * gate))
            want[t, j] = ws[2][e] @ ((up + 1) * gate * sigmoid) + bs[2][e]
    assert np.abs(want).max() > 7  # the clamps and biases matter
    run = jax.jit(moe.expert_swiglu, static_argnames="backend")
    for backend in ("xla", PALLAS_INTERPRET):
        got = run(jnp.asarray(x), jnp.asarray(ids), ex, backend=backend)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-3 * np.abs(want).max())


@pytest.mark.warmup  # holds 0 compilations after warm-up
def test_mxfp4_hub_layout_kept_packed_equals_transformers(checkpoint, mxfp4_checkpoint):
    """gpt-oss's MXFP4 hub format: the experts stay packed in device memory (Mxfp4Weight, at most
    0.3x their bfloat16 bytes), unpacked inside the expert matmuls; transformers' greedy tokens and logprobs."""
    import jax

    from jaxserve.quantization.mxfp4 import Mxfp4Weight

    path, reference, ref_logprobs = mxfp4_checkpoint
    assert reference != checkpoint[1]  # the rounding to e2m1 changed the model: the packed weights are used
    engine = make_engine(path)
    try:
        experts = {k: v for k, v in engine.model.params["layers"].items() if k.startswith("we_")}
        assert len(experts) == 3 and all(isinstance(w, Mxfp4Weight) for w in experts.values())
        packed = sum(x.nbytes for w in experts.values() for x in jax.tree.leaves(w))
        bf16 = sum(2 * int(np.prod(w.shape)) for w in experts.values())
        assert packed <= 0.3 * bf16
        tokens, logprobs = engine_run(engine, PROMPTS, MAX_TOKENS)
        assert tokens == reference
        assert_logprobs_close(logprobs, ref_logprobs, what="mxfp4")
        assert engine.get_stats().num_compilations_after_warmup == 0
    finally:
        engine.shutdown()


@pytest.mark.warmup  # holds 0 compilations after warm-up
def test_pallas_interpret_backend_equals_transformers(checkpoint, monkeypatch):
    """The model on the Pallas backend in interpret mode (this CPU running the kernels' own code): the
    attention kernels with sinks and the per-layer window as data, the grouped expert matmul with the
    biases added per row -- transformers' tokens and logprobs, nothing compiled after warm-up."""
    from jaxserve.engine import llm_engine
    from jaxserve.models.attention import PALLAS_INTERPRET

    monkeypatch.setattr(llm_engine, "resolve_backend", lambda name: PALLAS_INTERPRET)
    engine = make_engine(checkpoint[0])
    try:
        assert engine.config.attention_backend == PALLAS_INTERPRET
        tokens, logprobs = engine_run(engine, PROMPTS, MAX_TOKENS)
        assert tokens == checkpoint[1]
        assert_logprobs_close(logprobs, checkpoint[2], what="pallas-interpret")
        assert engine.get_stats().num_compilations_after_warmup == 0
    finally:
        engine.shutdown()
