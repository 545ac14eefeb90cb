"""Multi-head latent attention (DeepSeek V2/V3) decode over the latent paged pool, split-K.

The pool holds one entry per token, the latent c (R = kv_lora_rank values) then the rotary key
k_pe (rope values): 576 for V2/V3. With W_UK absorbed into the query (models/mla.py) every head
attends over those entries as one MQA head, keys [c | k_pe], values c:

    score_h,j = sm_scale * (q_lat_h . c_j + q_pe_h . k_pe_j)      out_h = sum_j softmax_j * c_j

FlashMLA's design: one program per (sequence, head group, split) reads each cache block of its
share of the sequence once for all the heads of its group (a [BS, R] latent tile and a [BS, rope]
rotary tile, both powers of two: the 576-wide entry is never loaded as one tile), scores them as
two dots, takes the same latent tile as the values, and keeps an online softmax across blocks; the
wrapper merges the splits by their log-sum-exp, as paged_attention_decode does. The block size is
the pool's. Splitting the context keeps the SMs busy when few sequences decode; the split count
shrinks as the batch grows (the head groups x sequences already fill the GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    NEG_INF,
    check_int_array,
    next_power_of_2,
    scalars,
    shape_class,
    triton_params,
)
from pallas_kernels.paged_attention_decode import paged_attention_decode_reference
from pallas_kernels.ragged_paged_attention import dot_nn, dot_nt

_STATIC = ("kv_lora_rank", "sm_scale")

# Tuning, keyed by max_blocks_per_seq * block_size (the longest context a batch can hold): the
# most splits of the context. Untuned guesses (no GPU run of this kernel yet).
MAX_SPLITS: dict[int, int] = {256: 1, 1024: 2, 4096: 4, 16384: 8, 131072: 16}
# Programs that fill an H100/H200 (132 SMs) about twice: splits beyond that only add merge work.
TARGET_PROGRAMS = 264
# Heads sharing one read of a block: 16 rows at least (tl.dot), 64 at most (FlashMLA's tile; the
# [64, 512] float32 accumulator is 128 KiB of registers, 8 warps).
MIN_HEADS, MAX_HEADS = 16, 64


def _check(q: jax.Array, pool: jax.Array, kv_lens: jax.Array, block_tables: jax.Array,
           layer: jax.Array | int | None, kv_lora_rank: int, sm_scale: float) -> None:
    want = 4 if layer is None else 5
    if pool.ndim != want or pool.shape[-4] != 1:
        raise ValueError(f"pool must be {want}-D [{'num_layers, ' if layer is not None else ''}1, num_blocks, "
                         f"block_size, kv_lora_rank + rope]; got shape {pool.shape}")
    if q.ndim != 3 or q.shape[-1] != pool.shape[-1]:
        raise ValueError(f"q must be [num_seqs, num_heads, {pool.shape[-1]}] (the pool's width); got {q.shape}")
    if not 0 < kv_lora_rank < pool.shape[-1]:
        raise ValueError(f"kv_lora_rank must be in (0, {pool.shape[-1]}); got {kv_lora_rank}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive float; got {sm_scale}")
    check_int_array("kv_lens", kv_lens, (q.shape[0],))
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables must be [num_seqs={q.shape[0]}, max_blocks_per_seq]; got {block_tables.shape}")
    check_int_array("block_tables", block_tables, block_tables.shape)


@functools.partial(jax.jit, static_argnames=_STATIC)
def mla_decode_reference(
    q: jax.Array,  # [S, H, R + rope]: W_UK^T q_nope, then q_pe
    pool: jax.Array,  # [(L,) 1, NB, BS, R + rope]
    kv_lens: jax.Array,  # i32[S]; 0 for padding rows (output 0)
    block_tables: jax.Array,  # i32[S, MB]
    *,
    kv_lora_rank: int,
    sm_scale: float,
    layer: jax.Array | int | None = None,
) -> jax.Array:  # [S, H, R]
    """The XLA path: the pool as both keys and values of one MQA head, the values' rotary part dropped."""
    _check(q, pool, kv_lens, block_tables, layer, kv_lora_rank, sm_scale)
    out = paged_attention_decode_reference(q, pool, pool, kv_lens, block_tables, sm_scale=sm_scale, layer=layer)
    return out[..., :kv_lora_rank]


def _mla_kernel(
    kv_lens_ref,  # i32[S]
    layer_ref,  # i32[2]: the layer of a stacked pool (and an unused window slot)
    block_tables_ref,  # i32[S, MB]
    q_lat_ref,  # [HB, R]: sequence s, head group g
    q_pe_ref,  # [HB, rope]
    pool_ref,  # [(L,) 1, NB, BS, R + rope]
    acc_ref,  # f32[HB, R]: partial of split k
    m_ref,  # f32[HB]
    l_ref,  # f32[HB]
    *,
    num_splits: int,
    sm_scale: float,
    stacked: bool,
):
    s, split = pl.program_id(0), pl.program_id(2)
    block_size = pool_ref.shape[-2]
    rank, rope = q_lat_ref.shape[-1], q_pe_ref.shape[-1]
    rows = q_lat_ref.shape[0]
    kv_len = kv_lens_ref[s]
    last = (kv_len + block_size - 1) // block_size
    per_split = (last + num_splits - 1) // num_splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, last)
    q_lat, q_pe = q_lat_ref[...], q_pe_ref[...]
    in_block = lax.broadcasted_iota(jnp.int32, (block_size,), 0)

    def body(j, carry):
        m, l, acc = carry  # [HB], [HB], [HB, R] float32
        head = (0, block_tables_ref[s, j], slice(None))
        if stacked:
            head = (layer_ref[0],) + head
        lat = pool_ref[head + (pl.ds(0, rank),)]  # [BS, R]: keys' first part and the values
        pe = pool_ref[head + (pl.ds(rank, rope),)]  # [BS, rope]
        if jnp.dtype(lat.dtype).itemsize == 1:  # an fp8 pool: widen the tiles, not q and p to fp8
            lat, pe = lat.astype(jnp.bfloat16), pe.astype(jnp.bfloat16)
        # tl.dot takes operands of one dtype: q in the pool's (a float32 model over a bfloat16 pool).
        scores = (dot_nt(q_lat.astype(lat.dtype), lat) + dot_nt(q_pe.astype(pe.dtype), pe)) * sm_scale
        live = j * block_size + in_block < kv_len  # [BS]
        scores = jnp.where(live[None, :], scores, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        p = jnp.where(live[None, :], jnp.exp(scores - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        # Slots past kv_len may hold NaN/inf from a freed request: 0 * NaN is NaN.
        lat = jnp.where(live[:, None], lat, jnp.zeros_like(lat))
        acc = acc * alpha[:, None] + dot_nn(p.astype(lat.dtype), lat)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, rank), jnp.float32))
    m, l, acc = lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def launch_shape(num_seqs: int, num_heads: int, context: int) -> tuple[int, int, int, int]:
    """(heads per program, head groups, splits, num_warps) for a batch: the head group as wide as
    the heads (up to 64), the splits as many as fill the GPU about twice, within MAX_SPLITS."""
    heads = min(max(MIN_HEADS, next_power_of_2(num_heads)), MAX_HEADS)
    groups = -(-num_heads // heads)
    most = MAX_SPLITS[shape_class(context, tuple(MAX_SPLITS))]
    splits = max(1, min(most, -(-TARGET_PROGRAMS // (num_seqs * groups))))
    return heads, groups, splits, 8 if heads >= 64 else 4


def _mla_pallas(q, pool, kv_lens, block_tables, layer, *, kv_lora_rank, sm_scale, interpret):
    num_seqs, num_heads, _ = q.shape
    block_size = pool.shape[-2]
    heads, groups, splits, warps = launch_shape(num_seqs, num_heads, block_tables.shape[1] * block_size)
    splits = min(splits, block_tables.shape[1])
    q = jnp.pad(q, ((0, 0), (0, heads * groups - num_heads), (0, 0)))  # [S, groups * HB, R + rope]
    q_lat, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    whole = pl.BlockSpec()
    part = (num_seqs, groups, splits, heads)
    acc, m, l = pl.pallas_call(
        functools.partial(_mla_kernel, num_splits=splits, sm_scale=sm_scale, stacked=pool.ndim == 5),
        grid=(num_seqs, groups, splits),
        in_specs=[whole, whole, whole,
                  pl.BlockSpec((None, heads, kv_lora_rank), lambda s, g, k: (s, g, 0)),
                  pl.BlockSpec((None, heads, q_pe.shape[-1]), lambda s, g, k: (s, g, 0)),
                  whole],
        out_specs=[pl.BlockSpec((None, None, None, heads, kv_lora_rank), lambda s, g, k: (s, g, k, 0, 0)),
                   pl.BlockSpec((None, None, None, heads), lambda s, g, k: (s, g, k, 0)),
                   pl.BlockSpec((None, None, None, heads), lambda s, g, k: (s, g, k, 0))],
        out_shape=[jax.ShapeDtypeStruct(part + (kv_lora_rank,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)],
        compiler_params=triton_params(warps, 2),
        interpret=interpret,
        name="mla_decode",
    )(kv_lens.astype(jnp.int32), scalars(layer, None), block_tables.astype(jnp.int32), q_lat, q_pe, pool)
    # Merge the splits: weights exp(m_k - max m), empty splits (l == 0) drop out.
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)  # [S, groups, K, HB]
    l_all = jnp.sum(l * w, axis=2)  # [S, groups, HB]
    acc_all = jnp.sum(acc * w[..., None], axis=2)  # [S, groups, HB, R]
    out = acc_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return out.reshape(num_seqs, groups * heads, kv_lora_rank)[:, :num_heads].astype(q.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC + ("interpret",))
def mla_decode(
    q: jax.Array,  # [S, H, R + rope]: W_UK^T q_nope, then q_pe
    pool: jax.Array,  # [(L,) 1, NB, BS, R + rope]
    kv_lens: jax.Array,  # i32[S]; 0 for padding rows (output 0)
    block_tables: jax.Array,  # i32[S, MB]
    *,
    kv_lora_rank: int,
    sm_scale: float,
    layer: jax.Array | int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [S, H, R]: each head's softmax-weighted sum of the latents
    """Pallas (Triton) MLA decode; the same semantics as mla_decode_reference."""
    _check(q, pool, kv_lens, block_tables, layer, kv_lora_rank, sm_scale)
    rope, block_size = pool.shape[-1] - kv_lora_rank, pool.shape[-2]
    if any(n & (n - 1) for n in (kv_lora_rank, rope, block_size)):
        raise ValueError(f"the Pallas MLA kernel needs power-of-two kv_lora_rank, rope width and block_size; got "
                         f"{kv_lora_rank}, {rope}, {block_size} (use mla_decode_reference)")
    if not jnp.issubdtype(pool.dtype, jnp.floating):
        raise ValueError(f"pool must be floating point for the Pallas kernel; got {pool.dtype} (use mla_decode_reference)")
    return _mla_pallas(q, pool, kv_lens, block_tables, layer, kv_lora_rank=kv_lora_rank, sm_scale=sm_scale,
                       interpret=interpret)
