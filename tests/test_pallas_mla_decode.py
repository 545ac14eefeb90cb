"""mla_decode (the Pallas MLA decode kernel, interpret mode) against the XLA absorbed path and a float64
oracle over ragged contexts and several block tables; lowered for `cuda` through jax.export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.mla_decode import launch_shape, mla_decode, mla_decode_reference
from pallas_kernels.testing import make_batch, numpy_attention, poison

KV_LENS = [1, 7, 16, 33, 64, 5, 24, 17]


def batch(rank: int, rope: int, heads: int, block_size: int, seed: int, pad_rows: int = 2):
    """A decode batch over a latent pool (one kv head of rank + rope); padding rows have kv_len 0."""
    b = make_batch(np.random.default_rng(seed), [(1, n) for n in KV_LENS], num_kv_heads=1, group=heads,
                   head_dim=rank + rope, block_size=block_size, max_num_seqs=len(KV_LENS) + pad_rows)
    b.kv_lens[b.num_seqs:] = 0
    b.q = np.random.default_rng(seed + 1).standard_normal((len(b.kv_lens), heads, rank + rope)).astype(np.float32)
    b.cu_q_lens = np.arange(len(b.kv_lens) + 1, dtype=np.int32)
    b.v_cache = b.k_cache  # the latent is the values
    return b


def run(fn, b, pool: np.ndarray, rank: int, **kw):
    return np.asarray(fn(jnp.asarray(b.q), jnp.asarray(pool), jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables),
                         kv_lora_rank=rank, sm_scale=0.1, **kw))


# (kv_lora_rank, rope, heads, block_size): V2/V3's 512 + 64 with 20 heads (two head groups of 16, the
# second padded) in FlashMLA's 64-token blocks; a small pool of 8-token blocks (the tiny test models')
SWEEP = [(512, 64, 20, 64), (32, 8, 4, 8)]


@pytest.mark.parametrize("rank,rope,heads,block_size", SWEEP)
def test_kernel_equals_the_xla_path_and_the_oracle(rank, rope, heads, block_size):
    """The kernel reads layer 1 of a stacked [L, 1, ...] pool at a traced layer index, with NaN in every
    slot no sequence owns (freed blocks, tails past kv_len): the XLA path's and the oracle's outputs on
    the clean pool, for two block tables (and placements of the contexts) per shape."""
    kernel = jax.jit(lambda q, p, kl, bt, layer: mla_decode(q, p, kl, bt, kv_lora_rank=rank, sm_scale=0.1,
                                                             layer=layer, interpret=True))
    for seed in (0, 1):
        b = batch(rank, rope, heads, block_size, seed)
        want = numpy_attention(b, sm_scale=0.1)[..., :rank]
        xla = run(mla_decode_reference, b, b.k_cache, rank)
        stacked = np.stack([np.full_like(b.k_cache, 7.0), poison(b.k_cache, b.owned, np.nan)])
        got = np.asarray(kernel(jnp.asarray(b.q), jnp.asarray(stacked), jnp.asarray(b.kv_lens),
                                jnp.asarray(b.block_tables), jnp.int32(1)))
        assert got.shape == (len(b.kv_lens), heads, rank)
        np.testing.assert_allclose(got, xla, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        assert np.all(got[b.num_seqs:] == 0)


def test_launch_shape_shares_blocks_and_splits_small_batches():
    assert launch_shape(1, 16, 4096) == (16, 1, 4, 4)  # V2-Lite: all 16 heads on one read, 4 splits
    assert launch_shape(128, 16, 4096)[2] == 3  # 128 sequences nearly fill the GPU alone
    assert launch_shape(128, 128, 4096) == (64, 2, 2, 8)  # V3: two groups of 64 heads


def test_bad_shapes_are_value_errors():
    q, pool = jnp.zeros((2, 4, 40)), jnp.zeros((1, 4, 16, 40))
    ok = dict(kv_lora_rank=32, sm_scale=0.1)
    lens, tables = jnp.ones(2, jnp.int32), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="pool must be"):
        mla_decode(q, pool[None, None], lens, tables, **ok)
    with pytest.raises(ValueError, match="q must be"):
        mla_decode(q[..., :36], pool, lens, tables, **ok)
    with pytest.raises(ValueError, match="kv_lens"):
        mla_decode(q, pool, lens[:1], tables, **ok)
    with pytest.raises(ValueError, match="power-of-two"):
        mla_decode(jnp.zeros((2, 4, 44)), jnp.zeros((1, 4, 16, 44)), lens, tables, **ok)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_kernel_lowers_for_cuda(dtype):
    """V3's attention shape at TP 8 (16 heads), a stacked bf16 / fp8 pool of 64-token blocks, 128 sequences:
    a Triton kernel in a module for cuda (float32 queries as the model's absorbed q are bfloat16 here)."""
    q = jax.ShapeDtypeStruct((128, 16, 576), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 1, 512, 64, 576), dtype)
    lens, tables = jax.ShapeDtypeStruct((128,), jnp.int32), jax.ShapeDtypeStruct((128, 64), jnp.int32)
    fn = jax.jit(lambda q, p, kl, bt: mla_decode(q, p, kl, bt, kv_lora_rank=512, sm_scale=0.1, layer=1))
    exp = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, pool, lens, tables)
    text = exp.mlir_module()
    assert "xla.gpu.triton" in text and "mla_decode" in text
    assert exp.platforms == ("cuda",) and exp.out_avals[0].shape == (128, 16, 512)


def test_deepseek_decode_step_lowers_for_cuda_with_the_pool_in_place():
    """The engine's model step for a decode-only batch on the pallas backend, DeepSeek-V2-Lite's attention
    widths (kv_lora_rank 512, rope 64, 16 heads) on a tiny model: the MLA kernel is in the cuda module,
    once per layer scan, and the latent pool is donated and written in place (no pool-sized copy)."""
    from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from jaxserve.models import deepseek
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.kv_layout import pool_shapes
    from jaxserve.worker import hlo_checks
    from jaxserve.worker import model_runner as mr
    from jaxserve.worker.input_batch import pack
    from tests.deepseek_fixtures import CHECKPOINTS, COMMON

    hf = {**COMMON, **CHECKPOINTS["v2"][1], "architectures": ["DeepseekV2ForCausalLM"], "num_attention_heads": 16,
          "num_key_value_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
          "v_head_dim": 128}
    cfg = ModelConfig.from_hf(hf)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), deepseek.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    shapes = pool_shapes(cfg, 4001, 16)  # 4001 blocks: a shape nothing else in the program has
    kv = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes)
    out = SchedulerOutput([ScheduledRequest("a", [1], 20, [3, 4], True), ScheduledRequest("b", [2], 40, [5, 6, 7], True)], 2)
    batch, _ = pack(out, 8, 8, 8, 16, decode_only=True)
    rows = np.zeros(8, np.int32)
    exp = export.export(mr._model_step, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(params, kv, batch, rows, rows, cfg=cfg,
                                                                           backend="pallas")
    text = exp.mlir_module()
    assert text.count("mla_decode") >= 1 and "xla.gpu.triton" in text
    assert hlo_checks.stablehlo_problems(text, shapes[0], jnp.bfloat16, num_pools=1, allow_scatter=True) == []
