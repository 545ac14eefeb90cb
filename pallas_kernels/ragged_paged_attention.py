"""Ragged paged attention: mixed prefill / chunked-prefill / decode in one call.

The flat token batch is cut into q tiles of ``block_q`` tokens that never
straddle two sequences (tile metadata is computed in jnp by the wrapper); one
program per (q tile, kv head) runs a flash-style online softmax over the
sequence's cache blocks, one block per step. GQA: the kv head's whole query
group (padded to a power of two) rides along, so q rows are (token, group) pairs:

    q_rows[h] = [t0g0 t0g1 .. t0gG' t1g0 ..]   row r -> token start + r // G', head r % G'
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import (
    NEG_INF,
    cap_logits,
    check_cache,
    check_int_array,
    check_options,
    check_query,
    check_sinks,
    check_window,
    next_power_of_2,
    num_seqs_scalar,
    scalars,
    shape_class,
    token_positions,
    triton_params,
)
from pallas_kernels.reference_core import attend_reference, fold_sinks

_STATIC = ("sm_scale", "sliding_window", "soft_cap")

# Tuning, keyed by head_dim class: q rows per tile (tokens x padded group) and
# Triton launch parameters. Untuned guesses: the H200 figures in BENCHMARKS.md ran these.
TUNING: dict[int, dict[str, int]] = {
    64: {"q_rows": 64, "num_warps": 4, "num_stages": 2},
    128: {"q_rows": 64, "num_warps": 4, "num_stages": 2},
    256: {"q_rows": 32, "num_warps": 8, "num_stages": 1},
}


def _precision(a: jax.Array):
    """float32 operands: IEEE float32 dots. Triton's default for them is TF32 (10-bit mantissas),
    which put a float32 model's attention 3e-4 off the reference on an H200."""
    return lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b.T in float32; tl.dot needs every dim >= 16, else multiply-reduce."""
    if min(a.shape[0], b.shape[0], a.shape[1]) >= 16:
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a),
                               preferred_element_type=jnp.float32)
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None], axis=-1)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b in float32, same fallback as dot_nt."""
    if min(a.shape[0], a.shape[1], b.shape[1]) >= 16:
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a),
                               preferred_element_type=jnp.float32)
    return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None], axis=1)


def flash_block(q, k, v, q_pos, key_pos, kv_len, carry, *, sm_scale, sliding_window,
                soft_cap):
    """One online-softmax step of q [M, D] over one cache block k, v [BS, D]."""
    m, l, acc = carry  # [M], [M], [M, D] float32
    if jnp.dtype(k.dtype).itemsize == 1:  # an fp8 pool: widen the block rather than round q and p to fp8
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    # tl.dot takes operands of one dtype: q in the pool's (a float32 model over a bfloat16 pool).
    s = cap_logits(dot_nt(q.astype(k.dtype), k) * sm_scale, soft_cap)  # [M, BS]
    mask = key_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - sliding_window
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    # Slots past kv_len may hold NaN/inf from a freed request: 0 * NaN is NaN.
    v = jnp.where((key_pos < kv_len)[:, None], v, jnp.zeros_like(v))
    acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc


def _ragged_kernel(
    tile_seq_ref,  # i32[P]: sequence of q tile p
    tile_start_ref,  # i32[P]: first token of the tile
    tile_end_ref,  # i32[P]: end token of the tile's sequence (== start: dead tile)
    tile_posoff_ref,  # i32[P]: position of token t is t + posoff
    layer_ref,  # i32[2]: the layer (stacked pool), the sliding window when given as data
    block_tables_ref,  # i32[S, MB]
    q_ref,  # [Hkv, (T + BQ) * G', D]
    k_ref,  # [(L,) Hkv, NB, BS, D]
    v_ref,  # [(L,) Hkv, NB, BS, D]
    *refs,  # (sinks_ref f32[Hkv, M]: row r's sink, o_ref) with sinks, else (o_ref,)
    block_q: int,
    group: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    stacked: bool,
    window_data: bool,
):
    o_ref = refs[-1]  # [Hkv, (T + BQ) * G', D]
    if window_data:
        sliding_window = layer_ref[1]
    p, h = pl.program_id(0), pl.program_id(1)
    block_size, head_dim = k_ref.shape[-2], k_ref.shape[-1]
    rows = block_q * group
    seq, start = tile_seq_ref[p], tile_start_ref[p]
    end, posoff = tile_end_ref[p], tile_posoff_ref[p]
    kv_len = end + posoff
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    token = start + r // group  # [M]
    q_pos = token + posoff  # [M]
    q = q_ref[h, pl.ds(start * group, rows), :]  # [M, D]
    last = jnp.minimum(end, start + block_q) - 1
    hi = jnp.where(end > start, (last + posoff) // block_size + 1, 0)
    lo = 0
    if sliding_window is not None:
        lo = jnp.maximum(start + posoff - sliding_window + 1, 0) // block_size
    in_block = lax.broadcasted_iota(jnp.int32, (block_size,), 0)

    def body(j, carry):
        block = block_tables_ref[seq, j]
        idx = (h, block, slice(None), slice(None))
        if stacked:
            idx = (layer_ref[0],) + idx
        return flash_block(q, k_ref[idx], v_ref[idx], q_pos, j * block_size + in_block,
                           kv_len, carry, sm_scale=sm_scale,
                           sliding_window=sliding_window, soft_cap=soft_cap)

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    if len(refs) == 2:  # attention sinks: one more logit per row, with no value
        _, l, acc = fold_sinks(m, l, acc, refs[0][h, :])
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    live = jnp.broadcast_to((token < end)[:, None], (rows, head_dim))
    out_slot = o_ref.at[h, pl.ds(start * group, rows), :]
    pltriton.store(out_slot, out, mask=live)


def _tiles(cu_q_lens, kv_lens, num_seqs, num_tokens: int, block_q: int):
    """Per-q-tile metadata; a tile holds block_q tokens of one sequence."""
    max_num_seqs = kv_lens.shape[0]
    cu = cu_q_lens.astype(jnp.int32)
    live = jnp.arange(max_num_seqs) < num_seqs
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)
    tiles = (q_lens + block_q - 1) // block_q
    cu_tiles = jnp.cumsum(tiles)
    num_tiles = -(-num_tokens // block_q) + max_num_seqs  # static bound
    p = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_tiles, p, side="right"), 0, max_num_seqs - 1)
    start = cu[seq] + (p - (cu_tiles[seq] - tiles[seq])) * block_q
    dead = p >= cu_tiles[-1]
    start = jnp.where(dead, 0, start).astype(jnp.int32)
    end = jnp.where(dead, 0, cu[seq + 1]).astype(jnp.int32)
    posoff = (kv_lens.astype(jnp.int32)[seq] - q_lens[seq] - cu[seq]).astype(jnp.int32)
    return seq.astype(jnp.int32), start, end, posoff


def _ragged_pallas(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, layer, sinks, window,
                   *, sm_scale, sliding_window, soft_cap, interpret):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-4]
    group = num_q_heads // num_kv_heads
    group_p = next_power_of_2(group)
    tune = TUNING[shape_class(head_dim, tuple(TUNING))]
    block_q = max(1, tune["q_rows"] // group_p)
    n = num_seqs_scalar(num_seqs)
    tile_meta = _tiles(cu_q_lens, kv_lens, n, num_tokens, block_q)
    # [T, Hq, D] -> [Hkv, (T + BQ) * G', D]: rows are (token, padded group) pairs.
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, block_q), (0, 0), (0, group_p - group), (0, 0)))
    q_rows = q4.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    layer_arr = scalars(layer, window)
    whole = pl.BlockSpec()
    extra = []
    if sinks is not None:  # [Hq] -> [Hkv, M]: the sink of each (token, padded group) row of a tile
        sink_rows = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group), ((0, 0), (0, group_p - group)))
        extra = [jnp.tile(sink_rows, (1, block_q))]
    out = pl.pallas_call(
        functools.partial(
            _ragged_kernel, block_q=block_q, group=group_p, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, stacked=k_cache.ndim == 5,
            window_data=window is not None),
        grid=(tile_meta[0].shape[0], num_kv_heads),
        in_specs=[whole] * (9 + len(extra)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=triton_params(tune["num_warps"], tune["num_stages"]),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*tile_meta, layer_arr, block_tables.astype(jnp.int32), q_rows, k_cache, v_cache, *extra)
    out = out.reshape(num_kv_heads, num_tokens + block_q, group_p, head_dim)
    out = out[:, :num_tokens, :group].transpose(1, 0, 2, 3).reshape(q.shape)
    # Padding tokens are never stored by the kernel: give them zeros, not garbage.
    total = cu_q_lens.astype(jnp.int32)[jnp.clip(n, 0, kv_lens.shape[0])]
    valid = (jnp.arange(num_tokens) < total) & (n > 0)
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))


def _check(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, layer,
           sm_scale, sliding_window, soft_cap, sinks, window, *, bits_ok: bool = False) -> None:
    num_kv_heads, _, _, head_dim = check_cache(k_cache, v_cache, layer, bits_ok=bits_ok)
    check_sinks(sinks, check_query(q, num_kv_heads, head_dim)[1])
    check_window(window)
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be 1-D [max_num_seqs]; got shape {kv_lens.shape}")
    max_num_seqs = kv_lens.shape[0]
    check_int_array("kv_lens", kv_lens, (max_num_seqs,))
    if block_tables.ndim != 2 or block_tables.shape[0] != max_num_seqs:
        raise ValueError(
            f"block_tables must be [max_num_seqs={max_num_seqs}, max_blocks_per_seq]; "
            f"got {block_tables.shape}"
        )
    check_int_array("block_tables", block_tables, block_tables.shape)
    check_int_array("cu_q_lens", cu_q_lens, (max_num_seqs + 1,))
    check_options(sm_scale, sliding_window, soft_cap)


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    v_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, MB]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array | int,  # i32 scalar or [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: jax.Array | int | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]: attention sinks (gpt-oss), or None
    window: jax.Array | None = None,  # i32 scalar: the sliding window as data (replaces sliding_window)
) -> jax.Array:  # [T, Hq, D]
    """Pure-jnp ragged paged attention (the CPU serving path); padding tokens get 0.

    window: one call's window as a traced value, so per-layer windows (gpt-oss's alternating
    sliding and full layers) run in one scanned program; a window at least as long as every
    context is full attention."""
    _check(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, layer,
           sm_scale, sliding_window, soft_cap, sinks, window, bits_ok=True)
    n = num_seqs_scalar(num_seqs)
    seq_ids, q_pos = token_positions(cu_q_lens, kv_lens, n, q.shape[0])
    token_tables = block_tables.astype(jnp.int32)[seq_ids]  # [T, MB]
    cu = cu_q_lens.astype(jnp.int32)
    new_start = kv_lens.astype(jnp.int32)[seq_ids] - (cu[seq_ids + 1] - cu[seq_ids])
    return attend_reference(
        q, k_cache, v_cache, token_tables, q_pos, seq_ids, new_start, sm_scale=sm_scale,
        sliding_window=sliding_window if window is None else jnp.asarray(window, jnp.int32).reshape(()),
        soft_cap=soft_cap, layer=layer, sinks=sinks,
    )


@functools.partial(jax.jit, static_argnames=_STATIC + ("interpret",))
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    v_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, MB]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array | int,  # i32 scalar or [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: jax.Array | int | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]: attention sinks (gpt-oss), or None
    window: jax.Array | None = None,  # i32 scalar: the sliding window as data (replaces sliding_window)
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """Pallas (Triton) ragged paged attention; same semantics as the reference."""
    _check(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, layer,
           sm_scale, sliding_window, soft_cap, sinks, window)
    head_dim, block_size = q.shape[-1], k_cache.shape[-2]
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(
            f"the Pallas kernel needs power-of-two head_dim and block_size; got "
            f"{head_dim}, {block_size} (use ragged_paged_attention_reference)"
        )
    return _ragged_pallas(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                          layer, sinks, window, sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, interpret=interpret)
