"""ragged_paged_attention: reference and Pallas kernel (interpret mode) vs a float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import BF16_BITS
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.testing import make_batch, numpy_attention, poison

CASES = {
    "decode_only": [(1, 5), (1, 17), (1, 1), (1, 32)],
    "prefill_only": [(7, 7), (16, 16), (1, 1)],
    "mixed": [(1, 9), (12, 12), (1, 33), (5, 5)],
    "chunked_prefill": [(6, 20), (1, 8), (16, 40)],
    "block_boundaries": [(8, 16), (16, 32), (1, 16), (32, 32)],
    # over 32 tokens: several query tiles of the CPU path, sequences straddling tiles,
    # a prompt spanning two tiles, continuations with cached context, decode in between
    "multi_tile": [(1, 70), (45, 45), (1, 3), (30, 70), (1, 1), (40, 100), (1, 50)],
    # a prompt over five tiles: tiles that need several tiles below them, in more than one
    # iteration of part B's pair list, some sharing an iteration
    "long_prompt": [(130, 130), (1, 9), (70, 100)],
    # decode tokens with speculative drafts after cached context: runs of up to 8 new tokens read
    # the cache token by token, longer ones in groups (reference_core._SHORT_RUN)
    "speculative": [(4, 40), (1, 17), (8, 30), (9, 50), (2, 3), (6, 70)],
}

# (case, block_size, head_dim, group, num_kv_heads): a covering sweep, not a product.
SWEEP = [
    ("decode_only", 8, 64, 1, 2),
    ("prefill_only", 16, 128, 3, 1),
    ("mixed", 32, 64, 8, 1),
    ("chunked_prefill", 8, 128, 8, 2),
    ("block_boundaries", 16, 64, 1, 2),
    ("mixed", 16, 128, 3, 2),
    ("chunked_prefill", 32, 64, 3, 1),
    ("block_boundaries", 8, 64, 3, 1),
    ("decode_only", 32, 128, 8, 1),
    ("prefill_only", 8, 64, 1, 2),
    ("multi_tile", 16, 64, 3, 1),
    ("multi_tile", 8, 64, 1, 2),
    ("long_prompt", 16, 64, 3, 1),
    ("speculative", 16, 64, 3, 1),
    ("speculative", 8, 128, 1, 2),
]


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-6))


def run(fn, b, dtype=jnp.float32, **kw):
    return fn(
        jnp.asarray(b.q, dtype), jnp.asarray(b.k_cache, dtype), jnp.asarray(b.v_cache, dtype),
        jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables), jnp.asarray(b.cu_q_lens),
        jnp.int32(b.num_seqs), **kw,
    )


def batch(case, block_size, head_dim, group, num_kv_heads, seed=0, dtype=np.float32, **kw):
    return make_batch(
        np.random.default_rng(seed), CASES[case], num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, block_size=block_size, dtype=dtype, **kw,
    )


@pytest.mark.parametrize("case,block_size,head_dim,group,num_kv_heads", SWEEP)
def test_reference_matches_numpy(case, block_size, head_dim, group, num_kv_heads):
    b = batch(case, block_size, head_dim, group, num_kv_heads, max_num_seqs=8, pad_tokens=3)
    scale = head_dim**-0.5
    out = run(ragged_paged_attention_reference, b, sm_scale=scale)
    assert rel_err(out, numpy_attention(b, sm_scale=scale)) < 1e-5
    assert np.all(np.asarray(out)[-3:] == 0)  # padding tokens


@pytest.mark.parametrize("window,cap", [(4, None), (None, 5.0), (9, 2.0), (1, None)])
def test_reference_window_and_soft_cap(window, cap):
    b = batch("chunked_prefill", 8, 64, 3, 2, seed=1, max_num_seqs=4, pad_tokens=1)
    out = run(ragged_paged_attention_reference, b, sm_scale=0.3,
              sliding_window=window, soft_cap=cap)
    ref = numpy_attention(b, sm_scale=0.3, sliding_window=window, soft_cap=cap)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("case,window,cap", [("multi_tile", 20, None), ("multi_tile", 37, 3.0),
                                             ("multi_tile", 1, None), ("long_prompt", 50, None),
                                             ("speculative", 5, None)])
def test_reference_multi_tile_window(case, window, cap):
    # Windows cutting into the cached part (A), into this step's part (B), and both; a window
    # of 50 over a 130-token prompt skips tile pairs far below the diagonal.
    b = batch(case, 8, 64, 3, 1, seed=3, max_num_seqs=8, pad_tokens=5)
    out = run(ragged_paged_attention_reference, b, sm_scale=0.3, sliding_window=window, soft_cap=cap)
    ref = numpy_attention(b, sm_scale=0.3, sliding_window=window, soft_cap=cap)
    assert rel_err(out, ref) < 1e-5
    assert np.all(np.asarray(out)[-5:] == 0)


def test_reference_bfloat16():
    b = batch("mixed", 16, 64, 3, 2, seed=2, dtype=jnp.bfloat16)
    out = run(ragged_paged_attention_reference, b, jnp.bfloat16, sm_scale=0.125)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, numpy_attention(b, sm_scale=0.125)) < 2e-2


@pytest.mark.parametrize("value", [None, np.nan])
def test_reference_reads_a_bfloat16_bits_pool(value):
    # A uint16 pool holding bfloat16 bits (the CPU layout of a bfloat16 KV cache) reads exactly
    # as a float32 pool holding the same bfloat16 values, unowned NaN blocks included.
    b = batch("multi_tile", 16, 64, 3, 1, seed=6, max_num_seqs=8, pad_tokens=2)
    b.k_cache, b.v_cache = (np.asarray(jnp.asarray(c, jnp.bfloat16).astype(jnp.float32)) for c in (b.k_cache, b.v_cache))
    if value is not None:
        b.k_cache, b.v_cache = poison(b.k_cache, b.owned, value), poison(b.v_cache, b.owned, value)
    want = np.asarray(run(ragged_paged_attention_reference, b, sm_scale=0.125))
    bits = lambda c: jax.lax.bitcast_convert_type(jnp.asarray(c, jnp.bfloat16), BF16_BITS)  # noqa: E731
    got = ragged_paged_attention_reference(
        jnp.asarray(b.q), bits(b.k_cache), bits(b.v_cache), jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables),
        jnp.asarray(b.cu_q_lens), jnp.int32(b.num_seqs), sm_scale=0.125)
    assert np.all(np.isfinite(want))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("value", [np.nan, 1e30])
def test_reference_ignores_unowned_blocks(value):
    b = batch("mixed", 8, 64, 3, 2, seed=3, max_num_seqs=6, pad_tokens=2)
    clean = np.asarray(run(ragged_paged_attention_reference, b, sm_scale=0.125))
    b.k_cache, b.v_cache = poison(b.k_cache, b.owned, value), poison(b.v_cache, b.owned, value)
    dirty = np.asarray(run(ragged_paged_attention_reference, b, sm_scale=0.125))
    assert np.all(np.isfinite(dirty))
    np.testing.assert_array_equal(dirty, clean)


def test_reference_stacked_layers_match_4d():
    b = batch("chunked_prefill", 16, 64, 3, 2, seed=4, max_num_seqs=4)
    other = np.random.default_rng(9).standard_normal(b.k_cache.shape).astype(np.float32)
    k5 = jnp.stack([jnp.asarray(other), jnp.asarray(b.k_cache), jnp.asarray(other)])
    v5 = jnp.stack([jnp.asarray(other), jnp.asarray(b.v_cache), jnp.asarray(other)])
    args = (jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables), jnp.asarray(b.cu_q_lens),
            jnp.int32(b.num_seqs))
    want = run(ragged_paged_attention_reference, b, sm_scale=0.125)
    got = ragged_paged_attention_reference(jnp.asarray(b.q), k5, v5, *args,
                                              sm_scale=0.125, layer=jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def body(carry, layer):  # the model's scan: the stacked cache rides in the carry
        out = ragged_paged_attention_reference(jnp.asarray(b.q), *carry, *args,
                                                  sm_scale=0.125, layer=layer)
        return carry, out

    _, outs = jax.lax.scan(body, (k5, v5), jnp.arange(3, dtype=jnp.int32))
    # Inside a scan XLA fuses the body differently: equal up to float rounding (the other
    # layers hold unrelated values, so reading a wrong layer would be far off).
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(want), rtol=0, atol=1e-6)


def test_reference_no_sequences_gives_zeros():
    b = batch("decode_only", 8, 64, 1, 1, max_num_seqs=4, pad_tokens=2)
    b.num_seqs = 0
    out = run(ragged_paged_attention_reference, b, sm_scale=0.125)
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("fn_name", ["ragged_paged_attention_reference", "ragged_paged_attention"])
def test_validation_errors(fn_name):
    fn = globals()[fn_name]
    b = batch("mixed", 8, 64, 3, 2)
    q, k, v = jnp.asarray(b.q), jnp.asarray(b.k_cache), jnp.asarray(b.v_cache)
    kv, bt, cu = jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables), jnp.asarray(b.cu_q_lens)
    n = jnp.int32(b.num_seqs)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        fn(q[:, :5], k, v, kv, bt, cu, n, sm_scale=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        fn(q[..., :32], k, v, kv, bt, cu, n, sm_scale=0.1)
    with pytest.raises(ValueError, match="shapes differ"):
        fn(q, k, v[:, :-1], kv, bt, cu, n, sm_scale=0.1)
    with pytest.raises(ValueError, match="dtypes differ"):
        fn(q, k, v.astype(jnp.bfloat16), kv, bt, cu, n, sm_scale=0.1)
    with pytest.raises(ValueError, match="floating point"):
        fn(q, k.astype(jnp.int32), v.astype(jnp.int32), kv, bt, cu, n, sm_scale=0.1)
    if fn_name == "ragged_paged_attention":  # bfloat16 bits are the XLA path's layout only
        with pytest.raises(ValueError, match="give the Pallas kernels bfloat16"):
            fn(q, k.astype(BF16_BITS), v.astype(BF16_BITS), kv, bt, cu, n, sm_scale=0.1)
    with pytest.raises(ValueError, match="cu_q_lens"):
        fn(q, k, v, kv, bt, cu[:-1], n, sm_scale=0.1)
    with pytest.raises(ValueError, match="kv_lens must be an integer"):
        fn(q, k, v, kv.astype(jnp.float32), bt, cu, n, sm_scale=0.1)
    with pytest.raises(ValueError, match="block_tables"):
        fn(q, k, v, kv, bt[:-1], cu, n, sm_scale=0.1)
    with pytest.raises(ValueError, match="5-D"):
        fn(q, k, v, kv, bt, cu, n, sm_scale=0.1, layer=0)
    with pytest.raises(ValueError, match="sliding_window"):
        fn(q, k, v, kv, bt, cu, n, sm_scale=0.1, sliding_window=0)


# Interpret mode is slow: a covering sweep of tiny shapes, each also vs float64.
KERNEL_SWEEP = [
    # case, block_size, head_dim, group, num_kv_heads, dtype, window, cap
    ("mixed", 8, 64, 3, 2, jnp.float32, None, None),
    ("chunked_prefill", 16, 128, 1, 1, jnp.float32, None, None),
    ("decode_only", 32, 64, 8, 1, jnp.float32, None, None),
    ("block_boundaries", 16, 64, 8, 1, jnp.bfloat16, None, None),
    ("prefill_only", 8, 128, 3, 1, jnp.bfloat16, None, None),
    ("chunked_prefill", 8, 64, 3, 1, jnp.float32, 5, 4.0),
]


@pytest.mark.parametrize("case,block_size,head_dim,group,num_kv_heads,dtype,window,cap",
                         KERNEL_SWEEP)
def test_kernel_matches_reference_and_numpy(case, block_size, head_dim, group, num_kv_heads,
                                            dtype, window, cap):
    b = batch(case, block_size, head_dim, group, num_kv_heads, seed=7,
              dtype=np.float32 if dtype == jnp.float32 else jnp.bfloat16,
              max_num_seqs=6, pad_tokens=2)
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = run(ragged_paged_attention, b, dtype, interpret=True, **kw)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert out.dtype == dtype
    assert rel_err(out, numpy_attention(b, **kw)) < tol
    ref = np.asarray(jnp.asarray(run(ragged_paged_attention_reference, b, dtype, **kw),
                                 jnp.float32), np.float64)
    assert rel_err(out, ref) < tol
    assert np.all(np.asarray(out, np.float32)[-2:] == 0)


def test_kernel_float32_queries_over_a_bfloat16_pool():
    # kv_cache_dtype="bfloat16" under a float32 model: the kernel and the reference agree.
    b = batch("mixed", 8, 64, 3, 2, seed=8, max_num_seqs=6, pad_tokens=2)
    args = (jnp.asarray(b.q), jnp.asarray(b.k_cache, jnp.bfloat16), jnp.asarray(b.v_cache, jnp.bfloat16),
            jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables), jnp.asarray(b.cu_q_lens), jnp.int32(b.num_seqs))
    out = ragged_paged_attention(*args, sm_scale=0.125, interpret=True)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125)
    assert out.dtype == jnp.float32
    assert rel_err(out, np.asarray(ref, np.float64)) < 2e-2
    assert rel_err(out, numpy_attention(b, sm_scale=0.125)) < 2e-2


@pytest.mark.parametrize("value", [np.nan, 1e30])
def test_kernel_ignores_unowned_blocks(value):
    b = batch("mixed", 8, 64, 3, 2, seed=3, max_num_seqs=6, pad_tokens=2)
    clean = np.asarray(run(ragged_paged_attention, b, sm_scale=0.125, interpret=True))
    b.k_cache, b.v_cache = poison(b.k_cache, b.owned, value), poison(b.v_cache, b.owned, value)
    dirty = np.asarray(run(ragged_paged_attention, b, sm_scale=0.125, interpret=True))
    assert np.all(np.isfinite(dirty))
    np.testing.assert_array_equal(dirty, clean)


def test_kernel_stacked_layers_match_4d():
    b = batch("chunked_prefill", 16, 64, 3, 1, seed=4, max_num_seqs=4)
    want = run(ragged_paged_attention, b, sm_scale=0.125, interpret=True)
    k5 = jnp.stack([jnp.full(b.k_cache.shape, jnp.nan), jnp.asarray(b.k_cache)])
    v5 = jnp.stack([jnp.full(b.v_cache.shape, jnp.nan), jnp.asarray(b.v_cache)])
    got = ragged_paged_attention(
        jnp.asarray(b.q), k5, v5, jnp.asarray(b.kv_lens), jnp.asarray(b.block_tables),
        jnp.asarray(b.cu_q_lens), jnp.int32(b.num_seqs), sm_scale=0.125, layer=jnp.int32(1),
        interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_rejects_non_power_of_two_head_dim():
    b = batch("mixed", 8, 64, 1, 1)
    with pytest.raises(ValueError, match="power-of-two"):
        ragged_paged_attention(
            jnp.asarray(b.q[..., :48]), jnp.asarray(b.k_cache[..., :48]),
            jnp.asarray(b.v_cache[..., :48]), jnp.asarray(b.kv_lens),
            jnp.asarray(b.block_tables), jnp.asarray(b.cu_q_lens), jnp.int32(b.num_seqs),
            sm_scale=0.1)


@pytest.mark.parametrize("group,num_kv_heads,head_dim,block_size,stacked", [
    (4, 8, 128, 16, False),  # Llama-3.1-8B
    (3, 3, 64, 16, True),  # SmolLM2-135M, stacked cache as the model scans it
    (1, 2, 64, 8, False),
])
def test_kernel_lowers_to_triton(group, num_kv_heads, head_dim, block_size, stacked):
    from functools import partial

    from jax import export

    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = sds(((4,) if stacked else ()) + (num_kv_heads, 512, block_size, head_dim), bf16)
    fn = partial(ragged_paged_attention, sm_scale=0.1, sliding_window=None,
                 layer=jnp.int32(2) if stacked else None)
    exp = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(sds((256, num_kv_heads * group, head_dim), bf16), cache, cache, sds((32,), i32),
      sds((32, 64), i32), sds((33,), i32), sds((), i32))
    assert "xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("dtype,want", [(jnp.float32, "HIGHEST"), (jnp.bfloat16, "None")])
def test_kernel_dots_are_ieee_for_float32(dtype, want):
    # Triton lowers a float32 dot with default precision to TF32, which put two float32 cases of
    # scripts/gpu_check.py 3e-4 off on an H200; HIGHEST lowers to IEEE. bfloat16 keeps the default.
    from pallas_kernels.ragged_paged_attention import dot_nn, dot_nt

    a = jnp.ones((16, 32), dtype)
    for fn, b in ((dot_nt, jnp.ones((16, 32), dtype)), (dot_nn, jnp.ones((32, 16), dtype))):
        (eqn,) = [e for e in jax.make_jaxpr(fn)(a, b).eqns if e.primitive.name == "dot_general"]
        assert want in str(eqn.params["precision"]), eqn.params["precision"]
