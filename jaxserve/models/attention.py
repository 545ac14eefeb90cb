"""Attention metadata for one step, and the backend switch between the Pallas kernels and the XLA path."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxserve.constants import resolve_attention_backend
from jaxserve.models import dense_attention
from pallas_kernels.common import BF16_BITS

# The Pallas kernels in interpret mode (a CPU run of the kernels' own code), for tests only: not in
# constants.RESOLVED_BACKENDS, so no user option reaches it; RunnerConfig(backend=PALLAS_INTERPRET) does.
PALLAS_INTERPRET = "pallas-interpret"
PALLAS_BACKENDS = ("pallas", PALLAS_INTERPRET)
# A window given as data that no context reaches: full attention in a layer of a model whose other
# layers slide (key_pos > q_pos - FULL_WINDOW holds for every key; no int32 overflow)
FULL_WINDOW = 1 << 30


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [num_tokens] i32: cache slot of each new token; negative = padding
    kv_lens: jax.Array  # [max_num_seqs] i32: context length of each sequence, new tokens included
    block_tables: jax.Array  # [max_num_seqs, max_blocks_per_seq] i32
    cu_q_lens: jax.Array  # [max_num_seqs + 1] i32: prefix sums of new-token counts
    num_seqs: jax.Array  # [1] i32: how many rows of the above are real
    # Static (part of the tree structure, so a separate compiled program): every sequence has
    # exactly one new token, token row i is sequence i. The Pallas backend then runs the decode
    # kernel, whose grid (sequence, kv head, split) fits such steps; the ragged kernel's query
    # tiles reached only 41-77% of copy bandwidth there (BENCHMARKS.md, "First GPU run").
    decode_only: bool = field(default=False, metadata=dict(static=True))
    # Sliding-window KV groups (worker/kv_groups.py; vLLM's hybrid allocator): every group's block
    # tables [G, max_num_seqs, max_blocks_per_seq] and slot mappings [G, T] (block_tables and
    # slot_mapping above are group 0's). A layer reads its group's through group_view. None: one table
    # for every layer (the same programs as before groups existed).
    group_block_tables: jax.Array | None = None
    group_slot_mapping: jax.Array | None = None


def group_view(md: AttentionMetadata, layer: jax.Array, group: jax.Array | None,
               slot: jax.Array | None) -> tuple[AttentionMetadata, jax.Array]:
    """The metadata and pool index one layer of the scan reads: with KV groups, its group's table
    and slot mapping (picked as data, so one layer body serves every group) and its slot in the
    pool's [k, ...] layer axis; without, `md` and the layer itself."""
    if md.group_block_tables is None or group is None:
        return md, layer
    return replace(md, block_tables=md.group_block_tables[group], slot_mapping=md.group_slot_mapping[group],
                   group_block_tables=None, group_slot_mapping=None), slot


def resolve_backend(name: str) -> str:
    """`auto` picks the Pallas kernels on GPU and the XLA path elsewhere; `reference` is `xla`."""
    return resolve_attention_backend(name, jax.default_backend())


def write_kv(backend: str, k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             md: AttentionMetadata, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k_cache, v_cache: [num_layers, num_kv_heads, num_blocks, block_size, head_dim]; k, v: [T, num_kv_heads, head_dim]."""
    if backend == dense_attention.DENSE:  # the training forward's: no pool (models/dense_attention.py)
        return dense_attention.write_kv(k_cache, v_cache, k, v)
    if backend in PALLAS_BACKENDS:
        return pallas_kernels.write_kv(k_cache, v_cache, k, v, md.slot_mapping, layer=layer,
                                       interpret=backend == PALLAS_INTERPRET)
    return pallas_kernels.write_kv_reference(k_cache, v_cache, k, v, md.slot_mapping, layer=layer)


def attend(backend: str, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
           layer: jax.Array, *, sm_scale: float, sliding_window: int | jax.Array | None,
           sinks: jax.Array | None = None, soft_cap: float | None = None) -> jax.Array:
    """q: [T, num_q_heads, head_dim] -> [T, num_q_heads, head_dim], causal over each sequence's paged context.

    sliding_window: an int (the same window in every layer, part of the program), None, or an i32
    scalar array: this layer's window as data (per-layer windows in one scanned layer body, gpt-oss's
    layer_types; FULL_WINDOW for a full-attention layer). sinks: f32[num_q_heads], this layer's
    attention sinks (gpt-oss: a learned logit per head in the softmax denominator), or None (no
    sinks: the same programs as without the argument). soft_cap: Gemma 2's attention logit soft-capping
    (scores -> tanh(s / cap) * cap after the scale, in every backend), or None."""
    if backend == dense_attention.DENSE:  # k_cache, v_cache: this layer's own K, V (models/dense_attention.py)
        return dense_attention.attend(q, k_cache, v_cache, md.cu_q_lens, md.slot_mapping, sm_scale=sm_scale,
                                      sliding_window=sliding_window, sinks=sinks, soft_cap=soft_cap)
    extra = {} if sinks is None else dict(sinks=sinks)
    if soft_cap is not None:
        extra["soft_cap"] = soft_cap
    if isinstance(sliding_window, jax.Array):
        extra["window"], sliding_window = sliding_window, None
    if backend in PALLAS_BACKENDS:
        kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, layer=layer,
                  interpret=backend == PALLAS_INTERPRET, **extra)
        if md.decode_only:
            kv_lens, tables = decode_rows(md, q.shape[0])
            return pallas_kernels.paged_attention_decode(q, k_cache, v_cache, kv_lens, tables, **kw)
        return pallas_kernels.ragged_paged_attention(q, k_cache, v_cache, md.kv_lens, md.block_tables,
                                                     md.cu_q_lens, md.num_seqs, **kw)
    return pallas_kernels.ragged_paged_attention_reference(
        q, k_cache, v_cache, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, layer=layer, **extra)


def decode_rows(md: AttentionMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """kv_lens [T], block_tables [T, max_blocks] for a decode-only step of T (padded) tokens: row i
    is sequence i; rows past num_seqs have kv_len 0 (the kernel writes 0 there). T is static, so
    this is a static slice or zero pad of the max_num_seqs rows."""
    n = md.kv_lens.shape[0]
    if num_tokens <= n:
        return md.kv_lens[:num_tokens], md.block_tables[:num_tokens]
    return (jnp.pad(md.kv_lens, (0, num_tokens - n)),
            jnp.pad(md.block_tables, ((0, num_tokens - n), (0, 0))))


# vLLM's fp8 KV cache names: fp8 is e4m3 (with the checkpoint's k/v scales when it has them).
FP8_KV_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def kv_values_dtype(kv_cache_dtype: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype K and V are kept in (EngineArgs.kv_cache_dtype; `auto` follows the model)."""
    if kv_cache_dtype in FP8_KV_DTYPES:
        return jnp.dtype(FP8_KV_DTYPES[kv_cache_dtype])
    return jnp.dtype(model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: jnp.dtype, backend: str) -> jnp.dtype:
    """The KV pool's array dtype. A bfloat16 pool on the XLA path holds its uint16 bits
    (BF16_BITS): XLA:CPU would widen a bfloat16 pool to float32 around every gather and scatter;
    the XLA attention widens what it gathers instead."""
    dtype = kv_values_dtype(kv_cache_dtype, model_dtype)
    return jnp.dtype(BF16_BITS) if dtype == jnp.bfloat16 and backend not in PALLAS_BACKENDS else dtype


def make_kv_cache(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                  dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """The preallocated pool: K and V, each [num_layers, num_kv_heads, num_blocks, block_size, head_dim]."""
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
