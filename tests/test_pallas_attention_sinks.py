"""Attention sinks (gpt-oss): the XLA references and both Pallas kernels (interpret mode) against a
float64 numpy softmax with the sink as a last logit column (transformers' GptOss eager attention),
`attend` with and without sinks, and lowering for cuda with sinks."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.models.attention import AttentionMetadata, attend
from pallas_kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.testing import make_batch, numpy_attention

MIXED = [(1, 9), (12, 12), (1, 33), (5, 20)]
DECODE_KV = [1, 7, 33, 64]


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-6))


def sinks_for(num_q_heads: int, seed: int = 0) -> np.ndarray:
    # Large and small sinks: some heads put most weight on the sink, some almost none.
    return (np.random.default_rng(seed).standard_normal(num_q_heads) * 3.0).astype(np.float32)


def ragged(b, fn, **kw):
    return fn(jnp.asarray(b.q), jnp.asarray(b.k_cache), jnp.asarray(b.v_cache), jnp.asarray(b.kv_lens),
              jnp.asarray(b.block_tables), jnp.asarray(b.cu_q_lens), jnp.int32(b.num_seqs), **kw)


def decode_batch(block_size, head_dim, group, num_kv_heads, seed=0):
    b = make_batch(np.random.default_rng(seed), [(1, n) for n in DECODE_KV], num_kv_heads=num_kv_heads,
                   group=group, head_dim=head_dim, block_size=block_size, max_num_seqs=len(DECODE_KV) + 2)
    b.kv_lens[b.num_seqs:] = 0
    b.q = np.random.default_rng(seed + 1).standard_normal(
        (len(b.kv_lens), b.q.shape[1], head_dim)).astype(np.float32)
    b.cu_q_lens = np.arange(len(b.kv_lens) + 1, dtype=np.int32)
    return b


def decode(b, fn, **kw):
    return fn(jnp.asarray(b.q), jnp.asarray(b.k_cache), jnp.asarray(b.v_cache), jnp.asarray(b.kv_lens),
              jnp.asarray(b.block_tables), **kw)


def test_numpy_oracle_is_the_softmax_with_a_sink_column():
    # One query, one head, three keys: the sink column by hand.
    b = make_batch(np.random.default_rng(0), [(1, 3)], num_kv_heads=1, group=1, head_dim=4, block_size=4)
    sink = np.array([0.7], np.float32)
    pos = np.arange(3)
    blocks = b.block_tables[0, pos // 4]
    k, v = b.k_cache[0, blocks, pos % 4].astype(np.float64), b.v_cache[0, blocks, pos % 4].astype(np.float64)
    logits = np.append(k @ b.q[0, 0].astype(np.float64) * 0.5, float(sink[0]))
    w = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(numpy_attention(b, sm_scale=0.5, sinks=sink)[0, 0], w[:3] @ v, rtol=1e-12)


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,window", [
    (8, 64, 1, 2, None), (16, 64, 3, 2, 5)])
def test_ragged_reference_and_kernel_match_numpy(block_size, head_dim, group, num_kv_heads, window):
    b = make_batch(np.random.default_rng(1), MIXED, num_kv_heads=num_kv_heads, group=group,
                   head_dim=head_dim, block_size=block_size, max_num_seqs=len(MIXED) + 1, pad_tokens=3)
    sinks = sinks_for(num_kv_heads * group)
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window)
    want = numpy_attention(b, sinks=sinks, **kw)
    assert rel_err(want, numpy_attention(b, **kw)) > 1e-2  # the sinks change the answer
    ref = ragged(b, ragged_paged_attention_reference, sinks=jnp.asarray(sinks), **kw)
    assert rel_err(ref, want) < 1e-5
    out = ragged(b, ragged_paged_attention, sinks=jnp.asarray(sinks), interpret=True, **kw)
    assert rel_err(out, want) < 1e-5
    num_real = int(b.cu_q_lens[b.num_seqs])
    assert np.all(np.asarray(out)[num_real:] == 0) and np.all(np.asarray(ref)[num_real:] == 0)


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,window,cols", [
    (8, 64, 3, 2, None, None), (8, 64, 8, 1, 6, 40)])
def test_decode_reference_and_kernel_match_numpy(block_size, head_dim, group, num_kv_heads, window, cols):
    b = decode_batch(block_size, head_dim, group, num_kv_heads)
    if cols:  # a wider table: several context splits merged with the sink in the wrapper
        extra = np.random.default_rng(0).integers(0, b.k_cache.shape[1],
                                                  (b.block_tables.shape[0], cols - b.block_tables.shape[1]))
        b.block_tables = np.concatenate([b.block_tables, extra.astype(np.int32)], axis=1)
    sinks = sinks_for(num_kv_heads * group, seed=2)
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window)
    want = numpy_attention(b, sinks=sinks, **kw)
    ref = decode(b, paged_attention_decode_reference, sinks=jnp.asarray(sinks), **kw)
    assert rel_err(ref, want) < 1e-5
    out = decode(b, paged_attention_decode, sinks=jnp.asarray(sinks), interpret=True, **kw)
    assert rel_err(out, want) < 1e-5
    assert np.all(np.asarray(out)[b.num_seqs:] == 0) and np.all(np.asarray(ref)[b.num_seqs:] == 0)


def test_attend_passes_sinks_and_none_is_unchanged():
    b = make_batch(np.random.default_rng(3), MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16)
    md = AttentionMetadata(slot_mapping=jnp.zeros(b.q.shape[0], jnp.int32), kv_lens=jnp.asarray(b.kv_lens),
                           block_tables=jnp.asarray(b.block_tables), cu_q_lens=jnp.asarray(b.cu_q_lens),
                           num_seqs=jnp.asarray([b.num_seqs], jnp.int32))
    k5, v5 = jnp.asarray(b.k_cache)[None], jnp.asarray(b.v_cache)[None]
    sinks = jnp.asarray(sinks_for(4, seed=4))
    md_decode = AttentionMetadata(md.slot_mapping, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
                                  decode_only=True)
    want = numpy_attention(b, sm_scale=0.125, sinks=np.asarray(sinks))
    for backend, meta, rows in (("xla", md, None), ("pallas-interpret", md_decode, 1)):
        q = jnp.asarray(b.q)[:rows]
        out = attend(backend, q, k5, v5, meta, jnp.int32(0), sm_scale=0.125, sliding_window=None, sinks=sinks)
        assert rel_err(out, want[:rows]) < 1e-5
    text = lambda s: jax.jit(lambda q: attend("xla", q, k5, v5, md, jnp.int32(0), sm_scale=0.125,  # noqa: E731
                                              sliding_window=None, sinks=s)).lower(jnp.asarray(b.q)).as_text()
    assert text(None) == jax.jit(lambda q: attend("xla", q, k5, v5, md, jnp.int32(0), sm_scale=0.125,
                                                  sliding_window=None)).lower(jnp.asarray(b.q)).as_text()


def test_validation_names_sinks():
    b = decode_batch(8, 64, 3, 2)
    for fn in (paged_attention_decode_reference, paged_attention_decode):
        with pytest.raises(ValueError, match="sinks"):
            decode(b, fn, sm_scale=0.1, sinks=jnp.zeros(5, jnp.float32))
        with pytest.raises(ValueError, match="sinks"):
            decode(b, fn, sm_scale=0.1, sinks=jnp.zeros(6, jnp.int32))
    with pytest.raises(ValueError, match="sinks"):
        ragged(b, ragged_paged_attention_reference, sm_scale=0.1, sinks=jnp.zeros((2, 3), jnp.float32))


@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_kernels_with_sinks_lower_for_cuda(kernel):
    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    num_kv_heads, group, head_dim = 8, 8, 64  # gpt-oss-20b's attention: 64 q heads, 8 kv heads
    cache = sds((4, num_kv_heads, 512, 16, head_dim), bf16)
    sinks = sds((num_kv_heads * group,), jnp.float32)
    if kernel == "ragged":
        fn = partial(ragged_paged_attention, sm_scale=0.125, sliding_window=128, layer=jnp.int32(1))
        args = (sds((256, num_kv_heads * group, head_dim), bf16), cache, cache, sds((32,), i32),
                sds((32, 64), i32), sds((33,), i32), sds((), i32))
    else:
        fn = partial(paged_attention_decode, sm_scale=0.125, layer=jnp.int32(1))
        args = (sds((32, num_kv_heads * group, head_dim), bf16), cache, cache, sds((32,), i32), sds((32, 64), i32))
    exp = export.export(jax.jit(lambda *a: fn(*a[:-1], sinks=a[-1])), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
                        )(*args, sinks)
    assert "xla.gpu.triton" in exp.mlir_module()
