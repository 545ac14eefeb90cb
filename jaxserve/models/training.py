"""The training forward: `forward(params, token_ids, positions, *, config) -> logits`, pure and
differentiable, over the param pytree the engine serves (`LLM.engine_params()`), so a JAX trainer
computes its loss with the engine's own model code and weights and hands the updated tree back
with `LLM.update_weights(params)` -- no conversion either way.

It is the serving decoder itself (llama.forward: every registered family's layers, norms, RoPE,
feed-forward blocks and experts) run with the `dense` attention backend
(jaxserve/models/dense_attention.py): each of the B rows attends causally over its own T tokens,
no KV pool, no block tables, nothing paged, and no loop whose trip count depends on the data
(reverse-mode differentiation needs that; MoE layers take their grouped path for the same reason).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models import llama
from jaxserve.models.attention import AttentionMetadata
from jaxserve.models.config import ModelConfig
from jaxserve.models.dense_attention import DENSE
from jaxserve.models.expert_weights import LAYER_VIEWS


def forward(params: llama.Params, token_ids: jax.Array, positions: jax.Array, *, config: ModelConfig,
            attention_mask: jax.Array | None = None) -> jax.Array:
    """token_ids, positions: [B, T] integers -> float32 logits [B, T, vocab] (row b, column t: the
    next-token logits after token_ids[b, :t + 1]).

    params: the engine's tree (`LLM.engine_params()`, or `load_model(...).params`); config: its
    ModelConfig (`LLM.llm_engine.model.config`). positions only rotate q and k (RoPE); causality
    (and a sliding window) counts packed columns, as transformers does. attention_mask [B, T]
    (1/True: a real token, as transformers'): keys where it is 0 are never attended (left or right
    padding); None: every token is real. Computed in the params' dtype; gradients need float
    params (a quantized tree runs, but its integer leaves have no gradient). Jit it yourself:
    `jax.jit(functools.partial(forward, config=cfg))`.
    """
    token_ids, positions = jnp.asarray(token_ids), jnp.asarray(positions)
    if token_ids.ndim != 2 or positions.shape != token_ids.shape:
        raise ValueError(f"token_ids and positions: [B, T] arrays of one shape; got {token_ids.shape} "
                         f"and {positions.shape}")
    batch, length = token_ids.shape
    if attention_mask is not None and jnp.shape(attention_mask) != token_ids.shape:
        raise ValueError(f"attention_mask: shape {jnp.shape(attention_mask)}, expected {token_ids.shape}")
    real = jnp.ones(batch * length, bool) if attention_mask is None else jnp.asarray(attention_mask).reshape(-1) > 0
    md = AttentionMetadata(
        slot_mapping=jnp.where(real, 0, -1).astype(jnp.int32),  # negative: padding, as in a serving step
        kv_lens=jnp.full((batch,), length, jnp.int32),
        block_tables=jnp.zeros((batch, 1), jnp.int32),  # unread: nothing is paged
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32) * length,  # B rows of T tokens
        num_seqs=jnp.array([batch], jnp.int32))
    params = _served_tree(params)
    # the "KV cache" the layer scan carries: one layer's K and V, in the activations' dtype
    dtype = params["embed"].dtype
    kv = (jnp.zeros((batch * length, config.num_kv_heads, config.head_dim), dtype),) * 2
    _, hidden = llama.forward(params, config, kv, token_ids.reshape(-1).astype(jnp.int32),
                              positions.reshape(-1).astype(jnp.int32), md, backend=DENSE)
    logits = llama.compute_logits(params, hidden, config.final_logit_softcap)  # Gemma 2's cap, else None
    return logits.reshape(batch, length, -1)


def token_logprobs(logits: jax.Array, token_ids: jax.Array) -> jax.Array:
    """logits [B, T, V] (forward's), token_ids [B, T] -> [B, T - 1] float32: the log-probability of
    token_ids[:, t + 1] after the first t + 1 tokens (log_softmax in float32), what a sampler's
    logprobs of those tokens are."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, token_ids[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]


def _served_tree(params: llama.Params) -> llama.Params:
    """params without the runner's per-layer views of MoE expert stacks (LAYER_VIEWS: zero-copy
    arrays over the stacks for the serving path's batched dots): the dense backend reads the stacks."""
    layers = params["layers"]
    if LAYER_VIEWS not in layers:
        return params
    return {**params, "layers": {k: v for k, v in layers.items() if k != LAYER_VIEWS}}
