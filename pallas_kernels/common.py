"""Validation and masking shared by the paged-attention kernels and references.

Layouts (per layer): ``k_cache``/``v_cache`` are ``[num_kv_heads, num_blocks,
block_size, head_dim]``; with ``layer`` given they are stacked over layers,
``[num_layers, num_kv_heads, num_blocks, block_size, head_dim]``, and only that
layer is read or written (gathered/scattered with the layer index, never sliced
out first, so a stacked cache carried through ``lax.scan`` is not copied).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity": exp(_NEG - m) is 0 and (_NEG - _NEG) is not NaN.
NEG_INF = -1e30

# A bfloat16 pool on the XLA (CPU) path is stored as its uint16 bits: XLA:CPU widens a bfloat16
# operand of a gather or scatter to float32 and back, the whole pool at every layer (5 s a step
# here), and its bf16 -> f32 convert is slow; integer gathers and scatters are left alone.
BF16_BITS = jnp.uint16


def to_float32(x: jax.Array) -> jax.Array:
    """Cache values as float32; BF16_BITS are widened by moving them into a float32's top half."""
    if x.dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x.astype(jnp.float32)


def to_storage(x: jax.Array, cache_dtype: jnp.dtype) -> jax.Array:
    """New K/V rows in the pool's dtype (BF16_BITS: rounded to bfloat16, then its bits)."""
    if cache_dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(cache_dtype)


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def check_cache(
    k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | int | None, *, bits_ok: bool = False
) -> tuple[int, int, int, int]:
    """Returns (num_kv_heads, num_blocks, block_size, head_dim) or raises ValueError.

    bits_ok: the XLA references also take a BF16_BITS pool; the Pallas kernels do not.
    """
    want = 4 if layer is None else 5
    if k_cache.ndim != want:
        what = "[num_kv_heads, num_blocks, block_size, head_dim]"
        if layer is not None:
            what = "[num_layers, " + what[1:]
        raise ValueError(
            f"k_cache must be {want}-D {what}"
            f"{' when layer is given' if layer is not None else ''}; got shape {k_cache.shape}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache shapes differ: {k_cache.shape} vs {v_cache.shape}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}"
        )
    if not jnp.issubdtype(k_cache.dtype, jnp.floating) and not (bits_ok and k_cache.dtype == BF16_BITS):
        hint = " (uint16 bfloat16 bits are the XLA path's layout: give the Pallas kernels bfloat16)"
        raise ValueError(f"k_cache must be floating point; got {k_cache.dtype}"
                         + (hint if k_cache.dtype == BF16_BITS else ""))
    if layer is not None:
        layer_arr = jnp.asarray(layer)
        if layer_arr.ndim != 0 or not jnp.issubdtype(layer_arr.dtype, jnp.integer):
            raise ValueError(
                f"layer must be an integer scalar; got shape {layer_arr.shape} "
                f"dtype {layer_arr.dtype}"
            )
    return tuple(k_cache.shape[-4:])  # type: ignore[return-value]


def check_int_array(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array; got dtype {x.dtype}")


def check_query(
    q: jax.Array, num_kv_heads: int, head_dim: int
) -> tuple[int, int]:
    """Returns (num_rows, num_q_heads) of a [rows, num_q_heads, head_dim] query."""
    if q.ndim != 3:
        raise ValueError(
            f"q must be 3-D [num_tokens, num_q_heads, head_dim]; got shape {q.shape}"
        )
    rows, num_q_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ValueError(f"q head_dim {q_dim} != cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point; got {q.dtype}")
    return rows, num_q_heads


def check_options(
    sm_scale: float, sliding_window: int | None, soft_cap: float | None
) -> None:
    if not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float; got {sm_scale}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None; got {sliding_window}")
    if soft_cap is not None and not float(soft_cap) > 0:
        raise ValueError(f"soft_cap must be > 0 or None; got {soft_cap}")


def check_window(window: jax.Array | None) -> None:
    """A sliding window given as data: None, or one integer (a scalar or shape [1])."""
    if window is None:
        return
    if jnp.size(window) != 1 or not jnp.issubdtype(jnp.result_type(window), jnp.integer):
        raise ValueError(f"window must be one integer (i32 scalar); got shape {jnp.shape(window)} "
                         f"dtype {jnp.result_type(window)}")


def scalars(layer: jax.Array | int | None, window: jax.Array | None) -> jax.Array:
    """i32[2]: the kernels' scalar operand, (the layer of a stacked pool, the window given as data)."""
    return jnp.stack([jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
                      jnp.asarray(0 if window is None else window, jnp.int32).reshape(())])


def check_sinks(sinks: jax.Array | None, num_q_heads: int) -> None:
    """Attention sinks: None, or one float logit per query head."""
    if sinks is None:
        return
    if tuple(sinks.shape) != (num_q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must be a float array of shape [num_q_heads={num_q_heads}]; "
                         f"got shape {tuple(sinks.shape)} dtype {sinks.dtype}")


def cap_logits(s: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma-2 style logit soft cap, applied after sm_scale and before masking."""
    if soft_cap is None:
        return s
    return soft_cap * jnp.tanh(s / soft_cap)


def key_mask(
    key_pos: jax.Array, q_pos: jax.Array, sliding_window: int | None
) -> jax.Array:
    """True where a query at q_pos may see a key at key_pos (broadcasting).

    Causal (key_pos <= q_pos) and, with a window, key_pos > q_pos - window.
    q_pos is -1 for padding queries, which therefore see nothing. Because
    q_pos <= kv_len - 1, every key at or beyond kv_len is masked as well.
    """
    ok = (key_pos <= q_pos) & (key_pos >= 0)
    if sliding_window is not None:
        ok &= key_pos > q_pos - sliding_window
    return ok


def first_key(q_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """Smallest key position a query at q_pos can see."""
    if sliding_window is None:
        return jnp.zeros_like(q_pos)
    return jnp.maximum(q_pos - sliding_window + 1, 0)


def num_seqs_scalar(num_seqs: jax.Array | int) -> jax.Array:
    arr = jnp.asarray(num_seqs, jnp.int32)
    if arr.size != 1:
        raise ValueError(f"num_seqs must be a scalar or shape [1]; got shape {arr.shape}")
    return arr.reshape(())


def token_positions(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array]:
    """Maps each flat token to (its sequence, its absolute position).

    Returns seq_ids i32[num_tokens] (clipped into range) and q_pos
    i32[num_tokens]: kv_len - q_len + i for token i of its sequence, or -1 for
    padding tokens at or beyond cu_q_lens[num_seqs].
    """
    max_num_seqs = kv_lens.shape[0]
    cu = cu_q_lens.astype(jnp.int32)
    live = jnp.arange(max_num_seqs) < num_seqs
    # Rows past num_seqs may hold garbage: push them past every token.
    ends = jnp.where(live, cu[1:], jnp.iinfo(jnp.int32).max)  # [max_num_seqs]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_ids = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    seq_ids = jnp.clip(seq_ids, 0, max_num_seqs - 1)
    total = cu[jnp.clip(num_seqs, 0, max_num_seqs)]
    q_len = cu[seq_ids + 1] - cu[seq_ids]
    q_pos = kv_lens.astype(jnp.int32)[seq_ids] - q_len + (t - cu[seq_ids])
    valid = (t < total) & (num_seqs > 0)
    return seq_ids, jnp.where(valid, q_pos, -1)


def triton_params(num_warps: int, num_stages: int):
    """Triton CompilerParams under its jax 0.10-0.12 names."""
    from jax.experimental.pallas import triton as pltriton

    cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def shape_class(value: int, bounds: tuple[int, ...]) -> int:
    """The smallest bound >= value (the last bound past them all): a tuning-table key."""
    for b in bounds:
        if value <= b:
            return b
    return bounds[-1]
