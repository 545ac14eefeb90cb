"""`quantization="int8"`: SmoothQuant folding keeps the float function, the int8 dot is close
to the float one, and on the real model the quantized engine (with a bfloat16 KV pool, the
README's CPU flags) stays close to float32."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.args import EngineArgs
from jaxserve.entrypoints.cli_args import add_serve_args, resolve
from jaxserve.quantization import QuantizedWeight, matmul
from jaxserve.quantization import quantize as quant
from jaxserve.models.config import ModelConfig
from tests.paged_helpers import paged_logits
from tests.parallel_worker import BASE, FAMILIES, random_params

PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [8, 1, 60]]
CONTINUATIONS = [[11, 12, 13], [200, 201, 202]]


def _family(name: str) -> tuple[ModelConfig, dict]:
    cfg = ModelConfig(**{**BASE, **FAMILIES[name]})
    params = jax.tree.map(jnp.asarray, random_params(cfg, seed=1))
    # An outlier channel in the residual stream, as real models have, so smoothing matters.
    params["embed"] = params["embed"].at[:, 3].mul(30.0)
    return cfg, params


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_bias_tied", "qwen3_qknorm", "llama_kv_fewer"])
def test_smoothing_keeps_the_float_function(family: str) -> None:
    cfg, params = _family(family)
    ids = quant.calibration_ids(None, cfg.vocab_size)[:64]
    smooth = quant.smooth_params(params, cfg, ids)
    assert set(smooth["layers"]) >= {"wqkv", "w_gate_up", "wo", "w_down"} and "lm_head" in smooth
    # The factors are not all 1: the folding is really exercised.
    assert not np.allclose(np.asarray(smooth["layers"]["attn_norm"]), np.asarray(params["layers"]["attn_norm"]))
    want = paged_logits(params, cfg, PROMPTS, CONTINUATIONS)
    got = paged_logits(smooth, cfg, PROMPTS, CONTINUATIONS)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4 * np.abs(w).max())


def test_int8_matmul_is_close_to_float() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 128)).astype(np.float32)
    x[:, 5] *= 20.0  # an outlier channel
    w = rng.standard_normal((128, 48)).astype(np.float32) * 0.1
    qw = quant.quantize_weight(jnp.asarray(w))
    assert isinstance(qw, QuantizedWeight) and qw.values.dtype == jnp.int8 and qw.scales.shape == (1, 48)
    got = np.asarray(matmul(jnp.asarray(x), qw))
    want = x @ w
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03
    assert np.all(np.asarray(matmul(jnp.zeros((2, 128)), qw)) == 0)  # an all-zero row: no NaN


def test_quantized_tiny_model_tracks_float() -> None:
    cfg, params = _family("llama_gqa")
    q = quant.quantize_params(params, cfg, "int8", quant.calibration_ids(None, cfg.vocab_size)[:64])
    assert q["layers"]["wqkv"].values.dtype == jnp.int8 and q["lm_head"].values.dtype == jnp.int8
    for w, g in zip(paged_logits(params, cfg, PROMPTS, CONTINUATIONS), paged_logits(q, cfg, PROMPTS, CONTINUATIONS)):
        cos = (w * g).sum(-1) / (np.linalg.norm(w, axis=-1) * np.linalg.norm(g, axis=-1))
        assert cos.min() > 0.99, cos


def test_quantization_arguments() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="bitsandbytes")
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization"):
        quant.quantize_params({}, None, "int4", np.zeros(4, np.int32))  # type: ignore[arg-type]
    parser = add_serve_args(argparse.ArgumentParser(), positional_model=False)
    assert resolve(parser.parse_args(["--quantization", "int8"])).engine.quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])


def test_kv_cache_dtype_arguments() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp8_e3m4")
    parser = add_serve_args(argparse.ArgumentParser(), positional_model=False)
    assert resolve(parser.parse_args(["--kv-cache-dtype", "bfloat16"])).engine.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


# Held-out text (not the calibration text): perplexity and top-1 agreement, teacher-forced.
EVAL_TEXT = (
    "The museum opened its doors in the spring, and within a week the queue stretched around the block. "
    "Visitors came to see the collection of clocks, some of them four hundred years old, which the founder "
    "had gathered on his travels through Europe and Asia. Each clock was wound by hand every morning. "
    "The curator explained that the oldest pieces were kept behind glass, because the humidity of the room "
    "changed with the number of people inside. In the evenings, a small team checked that every clock still "
    "kept time, and wrote the results in a notebook that has been kept since the first day.\n\n"
    "To install the package, run the installer and follow the prompts. If the installation fails, check "
    "that you have enough disk space and that your network connection is working, then try again. "
    "Most problems come from an old version of the runtime; updating it usually fixes them.\n\n"
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide "
    "into sugar and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts."
)


def _teacher_forced(llm: LLM) -> tuple[np.ndarray, float]:
    ids = llm.get_tokenizer()(EVAL_TEXT)["input_ids"]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    steps = out.prompt_logprobs[1:]
    top1 = np.array([max(d.items(), key=lambda kv: kv[1].logprob)[0] for d in steps])
    nll = -float(np.mean([d[t].logprob for d, t in zip(steps, ids[1:])]))
    return top1, nll


def test_int8_engine_on_the_default_model_stays_close(jax_default_model) -> None:
    kw = dict(max_num_seqs=1, max_num_batched_tokens=128, max_model_len=512, progress=False)
    ref = LLM(jax_default_model, kv_cache_dtype="auto", block_size=16, dtype="float32", **kw)  # exact float32
    ref_top1, ref_nll = _teacher_forced(ref)
    # 128-token chunks: the text's later chunks read the earlier ones back from the bfloat16 pool.
    llm = LLM(jax_default_model, quantization="int8", kv_cache_dtype="bfloat16", block_size=64, **kw)
    engine = llm.llm_engine
    assert engine.model.params["layers"]["wqkv"].values.dtype == jnp.int8
    assert engine.runner.kv[0].dtype == jnp.uint16  # bfloat16 bits, the CPU layout
    assert "tokens, bfloat16)" in engine.startup_report()  # the report names what the pool holds
    # Half the bytes a token: the same memory holds twice the tokens.
    assert abs(engine.num_gpu_blocks * 64 - 2 * ref.llm_engine.num_gpu_blocks * 16) <= 64
    top1, nll = _teacher_forced(llm)
    # Measured (211 tokens): perplexity 1.8% above float32's and top-1 agreement 0.962, the 128-token
    # chunks taking int8 weights with bfloat16 activations (the CPU's --dtype auto); with W8A8
    # throughout, before that: 1.3% and 0.934 (int8 alone: 2.7% and 0.938; a bfloat16 pool alone:
    # -0.1% and 0.995).
    assert np.exp(nll) / np.exp(ref_nll) < 1.05, (np.exp(nll), np.exp(ref_nll))
    assert (top1 == ref_top1).mean() > 0.85
    # Greedy generation works end to end and is not degenerate.
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text


@pytest.mark.multidevice
def test_quantized_weights_shard_with_their_scales_under_tensor_parallelism() -> None:
    """Two fake CPU devices in a subprocess (the device count is fixed once jax starts)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "tests.quant_tp_worker", "2"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    kernel = out.pop("kernel")
    for scheme, r in out.items():
        assert r["rel"] < 1e-5, (scheme, r)  # the same logits as on one device
        assert r["split"] == ["column", "row"], (scheme, r)  # shard_params tells each weight its split
        # column-parallel wq: values and scales split on N; row-parallel wo: values split on K
        blocks = 16 if scheme == "fp8_block" else 1  # block-wise fp8: a scale per 16 x 16 block
        assert r["wq_values"][-1] == r["wq_full"][-1] // 2 and r["wq_scales"][-1] == r["wq_values"][-1] // blocks
        assert r["wo_values"][1] == r["wo_full"][1] // 2
        assert "layers/wq/values" in r["summary"] and "layers/wq/scales" in r["summary"]  # the start-up table
    assert out["w4a16"]["wo_scales"][1] == out["w4a16"]["wo_scales_full"][1] // 2  # whole groups per device
    assert out["fp8"]["wo_scales"] == out["fp8"]["wo_scales_full"]  # per channel: whole on each device
    assert out["fp8_block"]["wo_scales"][1] == out["fp8_block"]["wo_scales_full"][1] // 2  # whole blocks per device
    # The W4A16 kernel (K 1024, N 2048, group 128) on each device's shard: exact in interpret mode,
    # and lowered for cuda with shard-sized operands (the whole packed weight is u8[512, 2048]).
    col, row = kernel["column"], kernel["row"]
    assert col["rel"] < 1e-5 and row["rel"] < 1e-5, kernel
    assert len(col["signatures"]) == len(row["signatures"]) == 1, kernel
    assert "tensor<16x1024xf32>, tensor<512x1024xui8>" in col["signatures"][0] and not col["all_reduce"], kernel
    assert "tensor<16x512xf32>, tensor<256x2048xui8>" in row["signatures"][0] and row["all_reduce"], kernel
