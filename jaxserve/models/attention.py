"""Attention metadata for one step, and the backend switch between the Pallas kernels and the XLA path."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxserve.constants import RESOLVED_BACKENDS, resolve_attention_backend
from pallas_kernels.common import BF16_BITS

BACKENDS = RESOLVED_BACKENDS  # ("xla", "pallas")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [num_tokens] i32: cache slot of each new token; negative = padding
    kv_lens: jax.Array  # [max_num_seqs] i32: context length of each sequence, new tokens included
    block_tables: jax.Array  # [max_num_seqs, max_blocks_per_seq] i32
    cu_q_lens: jax.Array  # [max_num_seqs + 1] i32: prefix sums of new-token counts
    num_seqs: jax.Array  # [1] i32: how many rows of the above are real


def resolve_backend(name: str) -> str:
    """`auto` picks the Pallas kernels on GPU and the XLA path elsewhere; `reference` is `xla`."""
    return resolve_attention_backend(name, jax.default_backend())


def write_kv(backend: str, k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             md: AttentionMetadata, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k_cache, v_cache: [num_layers, num_kv_heads, num_blocks, block_size, head_dim]; k, v: [T, num_kv_heads, head_dim]."""
    fn = pallas_kernels.write_kv if backend == "pallas" else pallas_kernels.write_kv_reference
    return fn(k_cache, v_cache, k, v, md.slot_mapping, layer=layer)


def attend(backend: str, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
           layer: jax.Array, *, sm_scale: float, sliding_window: int | None) -> jax.Array:
    """q: [T, num_q_heads, head_dim] -> [T, num_q_heads, head_dim], causal over each sequence's paged context."""
    fn = (pallas_kernels.ragged_paged_attention if backend == "pallas"
          else pallas_kernels.ragged_paged_attention_reference)
    return fn(q, k_cache, v_cache, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
              sm_scale=sm_scale, sliding_window=sliding_window, layer=layer)


def kv_values_dtype(kv_cache_dtype: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype K and V are kept in (EngineArgs.kv_cache_dtype; `auto` follows the model)."""
    return jnp.dtype(model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: jnp.dtype, backend: str) -> jnp.dtype:
    """The KV pool's array dtype. A bfloat16 pool on the XLA path holds its uint16 bits
    (BF16_BITS): XLA:CPU would widen a bfloat16 pool to float32 around every gather and scatter;
    the XLA attention widens what it gathers instead."""
    dtype = kv_values_dtype(kv_cache_dtype, model_dtype)
    return jnp.dtype(BF16_BITS) if dtype == jnp.bfloat16 and backend == "xla" else dtype


def make_kv_cache(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                  dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """The preallocated pool: K and V, each [num_layers, num_kv_heads, num_blocks, block_size, head_dim]."""
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
