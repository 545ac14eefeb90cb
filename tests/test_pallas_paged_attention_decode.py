"""paged_attention_decode: reference and Pallas kernel (interpret mode) vs a float64 oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_reference
from pallas_kernels.testing import make_batch, numpy_attention, poison

KV_LENS = [1, 7, 8, 16, 33, 64, 5, 24]

# (block_size, head_dim, group, num_kv_heads)
SWEEP = [(8, 64, 1, 2), (16, 128, 3, 1), (32, 64, 8, 1), (8, 128, 3, 2), (16, 64, 8, 2)]


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-6))


def batch(block_size, head_dim, group, num_kv_heads, seed=0, dtype=np.float32, pad_rows=2):
    b = make_batch(np.random.default_rng(seed), [(1, n) for n in KV_LENS],
                   num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                   block_size=block_size, max_num_seqs=len(KV_LENS) + pad_rows, dtype=dtype)
    # Decode layout: one query row per table row; padding rows have kv_len 0.
    b.kv_lens[b.num_seqs:] = 0
    q = np.random.default_rng(seed + 1).standard_normal(
        (len(b.kv_lens), b.q.shape[1], head_dim)).astype(dtype)
    b.q = q
    b.cu_q_lens = np.arange(len(b.kv_lens) + 1, dtype=np.int32)
    return b


def run(fn, b, dtype=jnp.float32, **kw):
    return fn(jnp.asarray(b.q, dtype), jnp.asarray(b.k_cache, dtype),
              jnp.asarray(b.v_cache, dtype), jnp.asarray(b.kv_lens),
              jnp.asarray(b.block_tables), **kw)


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads", SWEEP)
def test_reference_matches_numpy(block_size, head_dim, group, num_kv_heads):
    b = batch(block_size, head_dim, group, num_kv_heads)
    out = run(paged_attention_decode_reference, b, sm_scale=head_dim**-0.5)
    assert rel_err(out, numpy_attention(b, sm_scale=head_dim**-0.5)) < 1e-5
    assert np.all(np.asarray(out)[b.num_seqs:] == 0)


@pytest.mark.parametrize("window,cap", [(5, None), (None, 3.0), (16, 1.5)])
def test_reference_window_soft_cap_bf16(window, cap):
    b = batch(8, 64, 3, 2, seed=1, dtype=jnp.bfloat16)
    out = run(paged_attention_decode_reference, b, jnp.bfloat16, sm_scale=0.125,
              sliding_window=window, soft_cap=cap)
    ref = numpy_attention(b, sm_scale=0.125, sliding_window=window, soft_cap=cap)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("value", [np.nan, 1e30])
def test_reference_ignores_unowned_blocks(value):
    b = batch(8, 64, 3, 2, seed=2)
    clean = np.asarray(run(paged_attention_decode_reference, b, sm_scale=0.125))
    b.k_cache, b.v_cache = poison(b.k_cache, b.owned, value), poison(b.v_cache, b.owned, value)
    dirty = np.asarray(run(paged_attention_decode_reference, b, sm_scale=0.125))
    np.testing.assert_array_equal(dirty, clean)


def test_reference_stacked_layers_match_4d():
    b = batch(16, 64, 3, 2, seed=3)
    want = run(paged_attention_decode_reference, b, sm_scale=0.125)
    k5 = jnp.stack([jnp.full(b.k_cache.shape, jnp.nan), jnp.asarray(b.k_cache)])
    v5 = jnp.stack([jnp.full(b.v_cache.shape, jnp.nan), jnp.asarray(b.v_cache)])
    got = paged_attention_decode_reference(jnp.asarray(b.q), k5, v5, jnp.asarray(b.kv_lens),
                                           jnp.asarray(b.block_tables), sm_scale=0.125,
                                           layer=jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_validation_errors():
    b = batch(8, 64, 3, 2)
    q, k, v = jnp.asarray(b.q), jnp.asarray(b.k_cache), jnp.asarray(b.v_cache)
    kv, bt = jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables)
    fn = paged_attention_decode_reference
    with pytest.raises(ValueError, match="kv_lens"):
        fn(q, k, v, kv[:-1], bt, sm_scale=0.1)
    with pytest.raises(ValueError, match="block_tables"):
        fn(q, k, v, kv, bt[:-1], sm_scale=0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        fn(q[:, :5], k, v, kv, bt, sm_scale=0.1)
    with pytest.raises(ValueError, match="sm_scale"):
        fn(q, k, v, kv, bt, sm_scale=-1.0)
    with pytest.raises(ValueError, match="soft_cap"):
        fn(q, k, v, kv, bt, sm_scale=0.1, soft_cap=0.0)


# (block_size, head_dim, group, num_kv_heads, dtype, window, cap, table_cols)
KERNEL_SWEEP = [
    (8, 64, 3, 2, np.float32, None, None, None),
    (16, 128, 1, 1, np.float32, None, None, 70),  # 1120-token table: 4 splits
    (32, 64, 8, 1, jnp.bfloat16, None, None, None),
    (8, 64, 3, 1, np.float32, 6, 3.0, 40),  # 320-token table: 2 splits
]


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,dtype,window,cap,cols",
                         KERNEL_SWEEP)
def test_kernel_matches_reference_and_numpy(block_size, head_dim, group, num_kv_heads, dtype,
                                            window, cap, cols):
    b = batch(block_size, head_dim, group, num_kv_heads, seed=5, dtype=dtype)
    if cols:  # a wider table (garbage columns) selects more context splits
        extra = np.random.default_rng(0).integers(
            0, b.k_cache.shape[1], (b.block_tables.shape[0], cols - b.block_tables.shape[1]))
        b.block_tables = np.concatenate([b.block_tables, extra.astype(np.int32)], axis=1)
    jdt = jnp.float32 if dtype == np.float32 else jnp.bfloat16
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = run(paged_attention_decode, b, jdt, interpret=True, **kw)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    assert out.dtype == jdt
    assert rel_err(out, numpy_attention(b, **kw)) < tol
    ref = np.asarray(jnp.asarray(run(paged_attention_decode_reference, b, jdt, **kw),
                                 jnp.float32), np.float64)
    assert rel_err(out, ref) < tol
    assert np.all(np.asarray(out, np.float32)[b.num_seqs:] == 0)


@pytest.mark.parametrize("value", [np.nan, 1e30])
def test_kernel_ignores_unowned_blocks(value):
    b = batch(8, 64, 3, 2, seed=2)
    clean = np.asarray(run(paged_attention_decode, b, sm_scale=0.125, interpret=True))
    b.k_cache, b.v_cache = poison(b.k_cache, b.owned, value), poison(b.v_cache, b.owned, value)
    dirty = np.asarray(run(paged_attention_decode, b, sm_scale=0.125, interpret=True))
    assert np.all(np.isfinite(dirty))
    np.testing.assert_array_equal(dirty, clean)


def test_kernel_stacked_layers_match_4d():
    b = batch(16, 64, 3, 2, seed=3)
    want = run(paged_attention_decode, b, sm_scale=0.125, interpret=True)
    k5 = jnp.stack([jnp.full(b.k_cache.shape, jnp.nan), jnp.asarray(b.k_cache)])
    v5 = jnp.stack([jnp.full(b.v_cache.shape, jnp.nan), jnp.asarray(b.v_cache)])
    got = paged_attention_decode(jnp.asarray(b.q), k5, v5, jnp.asarray(b.kv_lens),
                                 jnp.asarray(b.block_tables), sm_scale=0.125,
                                 layer=jnp.int32(1), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_validation_errors():
    b = batch(8, 64, 3, 2)
    q, k, v = jnp.asarray(b.q), jnp.asarray(b.k_cache), jnp.asarray(b.v_cache)
    kv, bt = jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables)
    with pytest.raises(ValueError, match="kv_lens"):
        paged_attention_decode(q, k, v, kv[:-1], bt, sm_scale=0.1)
    with pytest.raises(ValueError, match="power-of-two"):
        paged_attention_decode(q[..., :48], k[..., :48], v[..., :48], kv, bt, sm_scale=0.1)


@pytest.mark.parametrize("batch_size,group,num_kv_heads,head_dim,block_size,cols,stacked", [
    (64, 4, 8, 128, 16, 256, False),  # Llama-3.1-8B, 4k contexts
    (32, 3, 3, 64, 16, 64, True),  # SmolLM2-135M, stacked cache
])
def test_kernel_lowers_to_triton(batch_size, group, num_kv_heads, head_dim, block_size, cols,
                                 stacked):
    from functools import partial

    import jax
    from jax import export

    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = sds(((4,) if stacked else ()) + (num_kv_heads, 4096, block_size, head_dim), bf16)
    fn = partial(paged_attention_decode, sm_scale=0.1, layer=jnp.int32(1) if stacked else None)
    exp = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(sds((batch_size, num_kv_heads * group, head_dim), bf16), cache, cache,
      sds((batch_size,), i32), sds((batch_size, cols), i32))
    assert "xla.gpu.triton" in exp.mlir_module()
