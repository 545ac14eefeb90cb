"""`--kv-cache-dtype fp8` (= fp8_e4m3) and fp8_e5m2: the XLA path, the Pallas kernels (interpret mode
and their cuda lowering), the model with and without a checkpoint's k/v scales."""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from jaxserve.engine.args import EngineArgs
from jaxserve.entrypoints.cli_args import add_serve_args, resolve
from jaxserve.models.attention import kv_pool_dtype, kv_values_dtype
from jaxserve.models.config import ModelConfig
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference, write_kv
from pallas_kernels.testing import make_batch, numpy_attention
from tests.paged_helpers import paged_logits
from tests.parallel_worker import BASE, FAMILIES, random_params
from tests.test_pallas_ragged_paged_attention import CASES

FP8 = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
PROMPTS, CONTINUATIONS = [[5, 17, 99, 3, 42, 7, 250], [8, 1, 60]], [[11, 12, 13], [200, 201, 202]]


@pytest.mark.parametrize("name", sorted(FP8))
def test_vllm_names_resolve_to_fp8_pools(name):
    assert kv_values_dtype(name, jnp.float32) == FP8[name]
    assert kv_pool_dtype(name, jnp.bfloat16, "xla") == FP8[name]  # not the bf16-bits layout
    assert EngineArgs(kv_cache_dtype=name).kv_cache_dtype == name
    parser = add_serve_args(argparse.ArgumentParser(), positional_model=False)
    assert resolve(parser.parse_args(["--kv-cache-dtype", name])).engine.kv_cache_dtype == name


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernel_over_an_fp8_pool_matches_the_reference(dtype):
    b = make_batch(np.random.default_rng(4), CASES["mixed"], num_kv_heads=2, group=3, head_dim=64, block_size=8,
                   dtype=np.float32)
    args = (jnp.asarray(b.q, jnp.bfloat16), jnp.asarray(b.k_cache, dtype), jnp.asarray(b.v_cache, dtype),
            jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables), jnp.asarray(b.cu_q_lens), jnp.int32(b.num_seqs))
    out = np.asarray(ragged_paged_attention(*args, sm_scale=0.125, interpret=True), np.float32)
    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.125), np.float32)
    # the expectation: numpy's float64 attention over the same values (q rounded to bfloat16, the
    # pools to the fp8 type, by ml_dtypes' numpy casts), not the kernels' own reference
    as_numpy = dataclasses.replace(b, q=b.q.astype(ml_dtypes.bfloat16).astype(np.float64),
                                   k_cache=b.k_cache.astype(np.dtype(dtype)).astype(np.float64),
                                   v_cache=b.v_cache.astype(np.dtype(dtype)).astype(np.float64))
    want = numpy_attention(as_numpy, sm_scale=0.125)
    for got in (out, ref):  # bfloat16 rounding of the probabilities p (8 bits) only
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def test_fp8_pool_kernels_lower_to_triton():
    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = sds((4, 8, 512, 16, 128), jnp.float8_e4m3fn)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    attend = functools.partial(ragged_paged_attention, sm_scale=0.1, layer=jnp.int32(1))
    exp = export.export(jax.jit(attend), platforms=["cuda"], disabled_checks=checks)(
        sds((256, 32, 128), bf16), cache, cache, sds((32,), i32), sds((32, 64), i32), sds((33,), i32), sds((), i32))
    assert "xla.gpu.triton" in exp.mlir_module()
    write = functools.partial(write_kv, layer=jnp.int32(1))
    exp = export.export(jax.jit(write), platforms=["cuda"], disabled_checks=checks)(
        cache, cache, sds((64, 8, 128), bf16), sds((64, 8, 128), bf16), sds((64,), i32))
    assert "xla.gpu.triton" in exp.mlir_module()


def _model():
    cfg = ModelConfig(**{**BASE, **FAMILIES["llama_gqa"]})
    return cfg, jax.tree.map(jnp.asarray, random_params(cfg, seed=2))


@pytest.mark.parametrize("dtype,bound", [(jnp.float8_e4m3fn, 0.2), (jnp.float8_e5m2, 0.5)])
def test_model_over_an_fp8_pool_stays_close(dtype, bound):
    # Measured on this random model (head_dim 8, so every rounded K element moves a score a lot):
    # max logit error 12% (e4m3) and 35% (e5m2: 2 mantissa bits) of the logits' range.
    cfg, params = _model()
    want = paged_logits(params, cfg, PROMPTS, CONTINUATIONS)
    got = paged_logits(params, cfg, PROMPTS, CONTINUATIONS, kv_dtype=dtype)
    for g, w in zip(got, want):
        rel = np.abs(g - w).max() / np.abs(w).max()
        assert 0 < rel < bound, rel  # rounded (not bit-exact)
        cos = (g * w).sum(-1) / (np.linalg.norm(g, axis=-1) * np.linalg.norm(w, axis=-1))
        assert cos.min() > 0.9, cos


def test_checkpoint_kv_scales_fold_into_the_cache():
    cfg, params = _model()
    # K and V past e4m3's largest value (448), q and wo shrunk to match: the same function, which
    # a pool without scales cannot hold.
    lay = params["layers"]
    layers = {**lay, "wk": lay["wk"] * 1000.0, "wv": lay["wv"] * 1000.0, "wq": lay["wq"] / 1000.0,
              "wo": lay["wo"] / 1000.0}
    big = {**params, "layers": layers}
    scales = {"k_scale": jnp.full((cfg.num_layers,), 1000.0), "v_scale": jnp.full((cfg.num_layers,), 1000.0)}
    scaled = {**big, "layers": {**layers, **scales}}
    want = paged_logits(big, cfg, PROMPTS, CONTINUATIONS)
    # In a float pool the scales change nothing (the same function)...
    for g, w in zip(paged_logits(scaled, cfg, PROMPTS, CONTINUATIONS), want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())
    # ...and in an e4m3 pool they keep K and V in range: close with them, lost without.
    err = lambda ps: max(float(np.nan_to_num(np.abs(g - w).max() / np.abs(w).max(), nan=np.inf))  # noqa: E731
                         for g, w in zip(paged_logits(ps, cfg, PROMPTS, CONTINUATIONS, kv_dtype=jnp.float8_e4m3fn),
                                         want))
    with_scales, without = err(scaled), err(big)
    assert with_scales < 0.2 and without > 1.0, (with_scales, without)
