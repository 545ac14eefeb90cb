"""Paged attention for decode-only steps: one new token per sequence, split-K.

One program per (sequence, kv head, split) walks its share of the sequence's
blocks with an online softmax and writes an unnormalised partial (acc, max,
sum); the wrapper merges the splits in jnp (log-sum-exp). Splitting the context
keeps every SM busy when the batch is small and contexts are long. GQA: the kv
head's query group is padded to G' = max(16, next_pow2(G)) rows so tl.dot applies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    NEG_INF,
    check_cache,
    check_int_array,
    check_options,
    check_query,
    check_sinks,
    check_window,
    next_power_of_2,
    scalars,
    shape_class,
    triton_params,
)
from pallas_kernels.ragged_paged_attention import flash_block
from pallas_kernels.reference_core import attend_reference, fold_sinks

_STATIC = ("sm_scale", "sliding_window", "soft_cap")

# Tuning, keyed by max_blocks_per_seq * block_size (the longest context a batch
# can hold): how many splits of the context, and Triton launch parameters.
# Untuned guesses: the H200 figures in BENCHMARKS.md ran these.
TUNING: dict[int, dict[str, int]] = {
    256: {"num_splits": 1, "num_warps": 4, "num_stages": 2},
    1024: {"num_splits": 2, "num_warps": 4, "num_stages": 2},
    4096: {"num_splits": 4, "num_warps": 4, "num_stages": 2},
    16384: {"num_splits": 8, "num_warps": 4, "num_stages": 2},
    131072: {"num_splits": 16, "num_warps": 4, "num_stages": 2},
}


def _check(q, k_cache, v_cache, kv_lens, block_tables, layer,
           sm_scale, sliding_window, soft_cap, sinks, window, *, bits_ok: bool = False) -> None:
    num_kv_heads, _, _, head_dim = check_cache(k_cache, v_cache, layer, bits_ok=bits_ok)
    num_seqs, num_q_heads = check_query(q, num_kv_heads, head_dim)
    check_sinks(sinks, num_q_heads)
    check_window(window)
    check_int_array("kv_lens", kv_lens, (num_seqs,))
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq]; "
            f"got {block_tables.shape}"
        )
    check_int_array("block_tables", block_tables, block_tables.shape)
    check_options(sm_scale, sliding_window, soft_cap)


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention_decode_reference(
    q: jax.Array,  # [S, Hq, D]
    k_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    v_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    kv_lens: jax.Array,  # i32[S]; 0 for padding rows (output 0)
    block_tables: jax.Array,  # i32[S, MB]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: jax.Array | int | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]: attention sinks (gpt-oss), or None
    window: jax.Array | None = None,  # i32 scalar: the sliding window as data (replaces sliding_window)
) -> jax.Array:  # [S, Hq, D]
    """Pure-jnp decode attention: the query of row s sits at position kv_lens[s] - 1."""
    _check(q, k_cache, v_cache, kv_lens, block_tables, layer,
           sm_scale, sliding_window, soft_cap, sinks, window, bits_ok=True)
    q_pos = kv_lens.astype(jnp.int32) - 1  # [S]; -1 (sees nothing) when kv_len == 0
    seq_ids = jnp.arange(q.shape[0], dtype=jnp.int32)
    return attend_reference(
        q, k_cache, v_cache, block_tables.astype(jnp.int32), q_pos, seq_ids, q_pos, sm_scale=sm_scale,
        sliding_window=sliding_window if window is None else jnp.asarray(window, jnp.int32).reshape(()),
        soft_cap=soft_cap, layer=layer, sinks=sinks,
    )


def _decode_kernel(
    kv_lens_ref,  # i32[S]
    layer_ref,  # i32[2]: the layer (stacked pool), the sliding window when given as data
    block_tables_ref,  # i32[S, MB]
    q_ref,  # [G', D]: sequence s, kv head h
    k_ref,  # [(L,) Hkv, NB, BS, D]
    v_ref,  # [(L,) Hkv, NB, BS, D]
    acc_ref,  # f32[G', D]: partial of split k
    m_ref,  # f32[G']
    l_ref,  # f32[G']
    *,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    stacked: bool,
    window_data: bool,
):
    s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if window_data:
        sliding_window = layer_ref[1]
    block_size, head_dim = k_ref.shape[-2], k_ref.shape[-1]
    rows = q_ref.shape[0]
    kv_len = kv_lens_ref[s]
    q_pos = jnp.full((rows,), kv_len - 1, jnp.int32)
    first = 0
    if sliding_window is not None:
        first = jnp.maximum(kv_len - sliding_window, 0) // block_size
    last = (kv_len + block_size - 1) // block_size
    per_split = (last - first + num_splits - 1) // num_splits
    lo = first + split * per_split
    hi = jnp.minimum(lo + per_split, last)
    q = q_ref[...]
    in_block = lax.broadcasted_iota(jnp.int32, (block_size,), 0)

    def body(j, carry):
        block = block_tables_ref[s, j]
        idx = (h, block, slice(None), slice(None))
        if stacked:
            idx = (layer_ref[0],) + idx
        return flash_block(q, k_ref[idx], v_ref[idx], q_pos, j * block_size + in_block,
                           kv_len, carry, sm_scale=sm_scale,
                           sliding_window=sliding_window, soft_cap=soft_cap)

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _decode_pallas(q, k_cache, v_cache, kv_lens, block_tables, layer, sinks, window,
                   *, sm_scale, sliding_window, soft_cap, interpret):
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-4]
    block_size = k_cache.shape[-2]
    group = num_q_heads // num_kv_heads
    group_p = max(16, next_power_of_2(group))
    tune = TUNING[shape_class(block_tables.shape[1] * block_size, tuple(TUNING))]
    num_splits = max(1, min(tune["num_splits"], block_tables.shape[1]))
    q4 = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_p - group), (0, 0)))  # [S, Hkv, G', D]
    layer_arr = scalars(layer, window)
    whole = pl.BlockSpec()
    part = (num_seqs, num_kv_heads, num_splits, group_p)
    acc, m, l = pl.pallas_call(
        functools.partial(
            _decode_kernel, num_splits=num_splits, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, stacked=k_cache.ndim == 5,
            window_data=window is not None),
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[whole, whole, whole,
                  pl.BlockSpec((None, None, group_p, head_dim), lambda s, h, k: (s, h, 0, 0)),
                  whole, whole],
        out_specs=[
            pl.BlockSpec((None, None, None, group_p, head_dim),
                         lambda s, h, k: (s, h, k, 0, 0)),
            pl.BlockSpec((None, None, None, group_p), lambda s, h, k: (s, h, k, 0)),
            pl.BlockSpec((None, None, None, group_p), lambda s, h, k: (s, h, k, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)],
        compiler_params=triton_params(tune["num_warps"], tune["num_stages"]),
        interpret=interpret,
        name="paged_attention_decode",
    )(kv_lens.astype(jnp.int32), layer_arr, block_tables.astype(jnp.int32), q4,
      k_cache, v_cache)
    # Merge the splits: weights exp(m_k - max m), empty splits (l == 0) drop out.
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)  # [S, Hkv, K, G']
    l_all = jnp.sum(l * w, axis=2)  # [S, Hkv, G']
    acc_all = jnp.sum(acc * w[..., None], axis=2)  # [S, Hkv, G', D]
    if sinks is not None:  # the sink is one more logit in the merged softmax
        sink_rows = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group), ((0, 0), (0, group_p - group)))
        _, l_all, acc_all = fold_sinks(m_all[:, :, 0], l_all, acc_all, sink_rows)
    out = acc_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return out[:, :, :group].reshape(q.shape).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC + ("interpret",))
def paged_attention_decode(
    q: jax.Array,  # [S, Hq, D]
    k_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    v_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    kv_lens: jax.Array,  # i32[S]; 0 for padding rows (output 0)
    block_tables: jax.Array,  # i32[S, MB]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: jax.Array | int | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]: attention sinks (gpt-oss), or None
    window: jax.Array | None = None,  # i32 scalar: the sliding window as data (replaces sliding_window)
    interpret: bool = False,
) -> jax.Array:  # [S, Hq, D]
    """Pallas (Triton) split-K decode attention; same semantics as the reference."""
    _check(q, k_cache, v_cache, kv_lens, block_tables, layer,
           sm_scale, sliding_window, soft_cap, sinks, window)
    head_dim, block_size = q.shape[-1], k_cache.shape[-2]
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(
            f"the Pallas kernel needs power-of-two head_dim and block_size; got "
            f"{head_dim}, {block_size} (use paged_attention_decode_reference)"
        )
    return _decode_pallas(q, k_cache, v_cache, kv_lens, block_tables, layer, sinks, window,
                          sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, interpret=interpret)
