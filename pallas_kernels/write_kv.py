"""Write new tokens' K/V into the paged cache (slot = block_id * block_size + offset).

One program per (token, kv head) copies a [head_dim] row into its slot; a
negative slot is padding and writes nothing. The caches are aliased to the
outputs, so a caller that donates them gets an in-place update.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import check_cache, check_int_array, shape_class, to_storage, triton_params

# Tuning, keyed by head_dim class: the write is a pure copy of one [head_dim] row.
TUNING: dict[int, dict[str, int]] = {
    64: {"num_warps": 1, "num_stages": 1},
    128: {"num_warps": 1, "num_stages": 1},
    256: {"num_warps": 2, "num_stages": 1},
}


def _check(k_cache, v_cache, k_new, v_new, slot_mapping, layer, *, bits_ok: bool = False) -> None:
    num_kv_heads, _, _, head_dim = check_cache(k_cache, v_cache, layer, bits_ok=bits_ok)
    if k_new.ndim != 3 or k_new.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_new must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache; "
            f"got {k_new.shape}"
        )
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new shape {v_new.shape} != k_new shape {k_new.shape}")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point; got {x.dtype}")
    check_int_array("slot_mapping", slot_mapping, (k_new.shape[0],))


def _split_slots(slot_mapping: jax.Array, num_blocks: int, block_size: int):
    slot = slot_mapping.astype(jnp.int32)
    # Negative slots go to block num_blocks (out of range) and are dropped.
    block = jnp.where(slot >= 0, slot // block_size, num_blocks)
    return block, slot % block_size


def _write_kv_kernel(
    slot_ref,  # i32[T]
    layer_ref,  # i32[1]
    k_new_ref,  # [D]: token t, kv head h
    v_new_ref,  # [D]
    k_in_ref,  # [(L,) Hkv, NB, BS, D]: aliased to k_out_ref
    v_in_ref,  # [(L,) Hkv, NB, BS, D]: aliased to v_out_ref
    k_out_ref,  # [(L,) Hkv, NB, BS, D]
    v_out_ref,  # [(L,) Hkv, NB, BS, D]
    *,
    block_size: int,
    stacked: bool,
):
    del k_in_ref, v_in_ref  # Same buffers as the outputs.
    t, h = pl.program_id(0), pl.program_id(1)
    slot = slot_ref[t]

    @pl.when(slot >= 0)
    def _():
        block, offset = slot // block_size, slot % block_size
        idx = (h, block, offset, slice(None))
        if stacked:
            idx = (layer_ref[0],) + idx
        k_out_ref[idx] = k_new_ref[...].astype(k_out_ref.dtype)
        v_out_ref[idx] = v_new_ref[...].astype(v_out_ref.dtype)


def _write_kv_pallas(k_cache, v_cache, k_new, v_new, slot_mapping, layer, *, interpret):
    num_tokens = k_new.shape[0]
    num_kv_heads, _, block_size, head_dim = k_cache.shape[-4:]
    stacked = k_cache.ndim == 5
    layer_arr = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    whole = pl.BlockSpec()
    row = pl.BlockSpec((None, None, head_dim), lambda t, h: (t, h, 0))
    tune = TUNING[shape_class(head_dim, tuple(TUNING))]
    return pl.pallas_call(
        functools.partial(_write_kv_kernel, block_size=block_size, stacked=stacked),
        grid=(num_tokens, num_kv_heads),
        in_specs=[whole, whole, row, row, whole, whole],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=triton_params(**tune),
        interpret=interpret,
        name="write_kv",
    )(slot_mapping.astype(jnp.int32), layer_arr, k_new, v_new, k_cache, v_cache)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(
    k_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    v_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    k_new: jax.Array,  # [T, Hkv, D]
    v_new: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]; negative = padding
    *,
    layer: jax.Array | int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pallas write of new K/V rows into their slots; in place when the caller donates."""
    _check(k_cache, v_cache, k_new, v_new, slot_mapping, layer)
    return tuple(_write_kv_pallas(k_cache, v_cache, k_new, v_new, slot_mapping, layer,
                                  interpret=interpret))


@jax.jit
def write_kv_reference(
    k_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    v_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    k_new: jax.Array,  # [T, Hkv, D]
    v_new: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]; negative = padding
    *,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp write: one scatter per cache, in place when the caller donates."""
    _check(k_cache, v_cache, k_new, v_new, slot_mapping, layer, bits_ok=True)
    _, num_blocks, block_size, _ = k_cache.shape[-4:]
    block, offset = _split_slots(slot_mapping, num_blocks, block_size)
    # All heads as a slice (a window dim of the scatter, updates [T, Hkv, D]) rather than an
    # arange index: a pool sharded on heads is then written shard-locally, with no collective.
    if layer is None:  # adjacent advanced indices stay in place: updates would be [Hkv, T, D]
        k_new, v_new = k_new.swapaxes(0, 1), v_new.swapaxes(0, 1)
        idx = (slice(None), block, offset)
    else:
        idx = (jnp.asarray(layer, jnp.int32), slice(None), block, offset)
    k_cache = k_cache.at[idx].set(to_storage(k_new, k_cache.dtype), mode="drop")
    v_cache = v_cache.at[idx].set(to_storage(v_new, v_cache.dtype), mode="drop")
    return k_cache, v_cache
