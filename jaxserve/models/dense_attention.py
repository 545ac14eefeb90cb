"""The `dense` attention backend: causal attention over whole sequences of equal length, no pool.

It is the training forward's (jaxserve/models/training.py): the serving layer scan
(llama.run_layers, and every family's own decoder) runs unchanged with backend="dense", and only
the two calls of jaxserve/models/attention.py that touch the pool change meaning:

    write_kv   the "pool" is this layer's own K and V ([T, nkv, hd], carried through the layer
               scan to attend and overwritten by the next layer): nothing is paged or kept
    attend     each of the step's B sequences (cu_q_lens: T / B tokens each, in order) attends
               causally over its own keys, by packed index; slot_mapping < 0 marks padding keys

Why not the XLA paged reference: its loops run a data-dependent number of times (fori_loop with
traced bounds), which reverse-mode differentiation cannot go through; this is plain einsums and
a softmax, so jax.grad runs through the whole model. Memory: scores are [B, nq, T, T] a layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DENSE = "dense"
_NEG = -1e30  # a finite "minus infinity": a fully masked row stays finite (no NaN in its gradient)


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layer's K, V [T, nkv, hd] as the scan's carry (in the carry's dtype)."""
    return k.astype(k_cache.dtype), v.astype(v_cache.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cu_q_lens: jax.Array, slot_mapping: jax.Array, *,
           sm_scale: float, sliding_window: int | jax.Array | None, sinks: jax.Array | None = None,
           soft_cap: float | None = None) -> jax.Array:
    """q [T, nq, hd], k, v [T, nkv, hd] -> [T, nq, hd] in q's dtype: B = len(cu_q_lens) - 1 sequences
    of T / B tokens each; a query sees the keys of its own sequence at or before it (and within
    `sliding_window` of it: an int, an i32 scalar, or None), and no key whose slot_mapping is negative.
    sinks f32[nq]: gpt-oss's per-head logit in the softmax denominator. soft_cap: Gemma 2's score
    capping. Scores and softmax in float32, as transformers' eager attention of a float32 model."""
    num_seqs = cu_q_lens.shape[0] - 1
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens % num_seqs:
        raise ValueError(f"dense attention: {num_tokens} tokens do not split into {num_seqs} equal sequences")
    seq_len, group = num_tokens // num_seqs, num_q_heads // num_kv_heads
    qh = q.astype(jnp.float32).reshape(num_seqs, seq_len, num_kv_heads, group, head_dim)
    kh = k.astype(jnp.float32).reshape(num_seqs, seq_len, num_kv_heads, head_dim)
    vh = v.astype(jnp.float32).reshape(num_seqs, seq_len, num_kv_heads, head_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qh, kh) * sm_scale  # [B, nkv, G, T, T]
    if soft_cap is not None:
        s = jnp.tanh(s / soft_cap) * soft_cap
    qi, ki = jnp.arange(seq_len)[:, None], jnp.arange(seq_len)[None, :]
    mask = ki <= qi
    if sliding_window is not None:
        mask = mask & (ki > qi - sliding_window)
    mask = mask[None] & (slot_mapping.reshape(num_seqs, 1, seq_len) >= 0)  # [B, T, T]
    s = jnp.where(mask[:, None, None], s, _NEG)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:  # a logit with no value: only the denominator grows
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1)
        m = jnp.maximum(m, sink)
    p = jnp.exp(s - jax.lax.stop_gradient(m))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - jax.lax.stop_gradient(m))
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p / denom, vh)  # [B, T, nkv, G, hd]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
