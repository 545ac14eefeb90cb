"""The sampler's LM head in float32 (`--head-dtype float32`): the logits a trainer computes.

By default the head runs in the model's dtype: a bfloat16 model's logits come out of a bfloat16
product, rounded to 8 mantissa bits (an error of |logit| / 512: tens of nats' worth of ranking
noise on rare tokens), then the log-softmax runs in float32. With head_float32 the product itself
is float32: bfloat16 (or float16) hidden states and weights are exact in float32, so the dot takes
them as they are and accumulates in float32 (`preferred_element_type`, HIGHEST precision: no TF32
on a GPU), and no float32 copy of the head is stored or made. A quantized head (int8, fp8) takes
float32 activations, so its rescaled output is float32 too.

The engine's float32 CPU default is unchanged by the flag, except that the sampler's bfloat16
head dots (engine/config.py's bf16_dots_from) are off: the runner passes head_dots=False.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models import llama
from jaxserve.quantization.matmul import columns, matmul

HEAD_DTYPES = ("auto", "float32")  # EngineArgs.head_dtype; auto: the model's dtype


def head_logits(params: llama.Params, hidden: jax.Array, float32: bool, soft_cap: float | None = None) -> jax.Array:
    """hidden [N, hidden] -> float32 logits [N, vocab]: llama.compute_logits, or its float32 product;
    soft_cap: the model's final logit soft-capping (Gemma 2), tanh(logits / cap) * cap."""
    head = params.get("lm_head")
    if not float32:
        logits = llama.compute_logits(params, hidden)
    elif head is None:  # tied: the embedding [vocab, hidden], contracted on its hidden axis as stored
        logits = _float32_dot(hidden, params["embed"], 1)
    elif isinstance(head, jax.Array):
        logits = _float32_dot(hidden, head, 0)
    else:
        logits = matmul(hidden.astype(jnp.float32), head).astype(jnp.float32)
    return _cap(logits, soft_cap)


def head_slice_logits(params: llama.Params, hidden: jax.Array, start: jax.Array, size: int, float32: bool,
                      dots: jnp.dtype | None = None, soft_cap: float | None = None) -> jax.Array:
    """head_logits' columns [start, start + size) (llama.slice_logits, the sampler's vocabulary slices)."""
    head = params.get("lm_head")
    if not float32:
        logits = llama.slice_logits(params, hidden, start, size, dots)
    elif head is None:
        logits = _float32_dot(hidden, jax.lax.dynamic_slice_in_dim(params["embed"], start, size, 0), 1)
    elif isinstance(head, jax.Array):
        logits = _float32_dot(hidden, jax.lax.dynamic_slice_in_dim(head, start, size, 1), 0)
    else:
        logits = matmul(hidden.astype(jnp.float32), columns(head, start, size)).astype(jnp.float32)
    return _cap(logits, soft_cap)


def _cap(logits: jax.Array, soft_cap: float | None) -> jax.Array:
    return logits if soft_cap is None else jnp.tanh(logits / soft_cap) * soft_cap


def _float32_dot(x: jax.Array, w: jax.Array, w_axis: int) -> jax.Array:
    """x [N, K] contracted with w's axis `w_axis` (K) in float32: both operands in their common
    dtype (exact in float32 for bfloat16 and float16), products accumulated in float32."""
    dtype = jnp.promote_types(x.dtype, w.dtype)
    return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (w_axis,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
