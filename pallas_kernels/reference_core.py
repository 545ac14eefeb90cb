"""Chunked online-softmax paged attention in pure jnp: the CPU serving path.

Shared by ``ragged_paged_attention_reference`` and
``paged_attention_decode_reference``. Every query token carries its own block
table row and absolute position; a ``lax.while_loop`` walks its context a
chunk of blocks at a time (flash-style running max / sum), so memory is
bounded by one chunk and the trip count by the longest live context, never by
``max_blocks_per_seq``:

    token t:  blocks  [start_t, start_t + C) [start_t + C, ...)  ...  up to q_pos_t
              gather k/v[t, C, heads, block_size, head_dim] per iteration
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import NEG_INF, cap_logits, first_key, key_mask

# Keys per loop iteration: measured on a 2-core CPU (SmolLM2-135M shapes), 64 keys
# beat 32 and 128+ (bigger chunks waste work on short contexts and spill caches).
_CHUNK_KEYS = 64
# Elements of one gathered K chunk (all tokens together): bounds peak memory.
_CHUNK_ELEMENTS = 1 << 23


def gather_blocks(
    cache: jax.Array, block_ids: jax.Array, layer: jax.Array | int | None
) -> jax.Array:
    """cache[(layer,) :, block_ids] laid out [*block_ids.shape, heads, block_size, dim]."""
    # Heads as a whole slice (not indexed by an arange) keep the head axis a pass-through
    # dimension of the gather: with the pool sharded on heads, each device gathers its own.
    # Advanced indices split by a slice put their dims first: [*block_ids.shape, heads, BS, D].
    if layer is None:
        cache, layer = cache[None], 0
    return cache[jnp.asarray(layer, jnp.int32), :, block_ids]


def attend_reference(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    v_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    token_tables: jax.Array,  # i32[T, MB]: each token's sequence's block table
    q_pos: jax.Array,  # i32[T]: absolute position, -1 for padding tokens
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    layer: jax.Array | int | None,
) -> jax.Array:  # [T, Hq, D] in q.dtype; padding tokens get zeros
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape[-4:]
    group = num_q_heads // num_kv_heads
    max_blocks = token_tables.shape[1]
    per_block = max(1, num_tokens * num_kv_heads * block_size * head_dim)
    chunk = int(max(1, min(_CHUNK_ELEMENTS // per_block, _CHUNK_KEYS // block_size, max_blocks)))
    chunk_keys = chunk * block_size

    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    q_pos = q_pos.astype(jnp.int32)
    start_block = first_key(q_pos, sliding_window) // block_size  # [T]
    span = q_pos + 1 - start_block * block_size
    num_chunks = jnp.where(q_pos >= 0, (span + chunk_keys - 1) // chunk_keys, 0)
    trip = jnp.max(num_chunks) if num_tokens else jnp.int32(0)

    offsets = jnp.arange(chunk, dtype=jnp.int32)
    in_block = jnp.arange(block_size, dtype=jnp.int32)

    def body(carry):
        j, m, l, acc = carry
        blk_idx = start_block[:, None] + j * chunk + offsets[None, :]  # [T, C]
        in_table = blk_idx < max_blocks
        blk_ids = jnp.take_along_axis(token_tables, jnp.minimum(blk_idx, max_blocks - 1), axis=1)
        blk_ids = jnp.clip(blk_ids, 0, num_blocks - 1)
        k = gather_blocks(k_cache, blk_ids, layer).astype(jnp.float32)  # [T, C, Hkv, BS, D]
        v = gather_blocks(v_cache, blk_ids, layer).astype(jnp.float32)  # [T, C, Hkv, BS, D]
        key_pos = blk_idx[:, :, None] * block_size + in_block  # [T, C, BS]
        mask = key_mask(key_pos, q_pos[:, None, None], sliding_window) & in_table[:, :, None]
        k = k.transpose(0, 2, 1, 3, 4).reshape(num_tokens, num_kv_heads, chunk_keys, head_dim)
        v = v.transpose(0, 2, 1, 3, 4).reshape(num_tokens, num_kv_heads, chunk_keys, head_dim)
        mask = mask.reshape(num_tokens, chunk_keys)
        s = jnp.einsum("thgd,thkd->thgk", qf, k)  # [T, Hkv, G, C * BS]
        s = cap_logits(s, soft_cap)
        s_mask = mask[:, None, None]  # [T, 1, 1, C * BS]
        s = jnp.where(s_mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))  # [T, Hkv, G]
        p = jnp.where(s_mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        # A freed block may hold NaN/inf: zero masked values so 0 * NaN never happens.
        v = jnp.where(mask[:, None, :, None], v, 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,thkd->thgd", p, v)
        return j + 1, m_new, l, acc

    init = (
        jnp.int32(0),
        jnp.full((num_tokens, num_kv_heads, group), NEG_INF, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, _, l, acc = lax.while_loop(lambda c: c[0] < trip, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
