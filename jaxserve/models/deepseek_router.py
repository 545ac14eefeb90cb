"""DeepSeek's expert selection (V2 and V3), as a `moe.Router.select`: the family's router function
in the shared MoE block (models/moe.py), whose expert paths are unchanged.

    method               scores                   groups (n_group of them)            top-k weights
    greedy               softmax(logits)          none                                the scores
    group_limited_greedy softmax(logits)          topk_group by their best score      the scores
    noaux_tc (V3)        sigmoid(logits)          topk_group by the sum of their      the unbiased scores
                         + correction bias        top 2 (biased) scores
                         (selection only)

then renormalised to sum 1 when norm_topk_prob, and times routed_scaling_factor (vLLM's order;
transformers' DeepseekV3TopkRouter does the same, its V2 router never renormalises and no V2
checkpoint asks it to). Experts outside the kept groups cannot be chosen. Scores in float32
(transformers keeps the gate in float32 too).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class GroupedTopK:
    """(logits f32 [T, E], correction bias [E] | None) -> (ids [T, k] i32, weights [T, k] f32)."""
    method: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"topk_method must be one of {METHODS}, got {self.method!r}")

    def __call__(self, logits: jax.Array, correction_bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        logits = logits.astype(jnp.float32)
        if self.method == "noaux_tc":
            scores = jax.nn.sigmoid(logits)
            bias = jnp.zeros(scores.shape[-1], jnp.float32) if correction_bias is None else correction_bias
            choice = scores + bias.astype(jnp.float32)
            group_score = jnp.sum(jax.lax.top_k(self._grouped(choice), min(2, self._group_size(choice)))[0], -1)
        else:
            scores = jax.nn.softmax(logits, axis=-1)
            choice = scores
            group_score = jnp.max(self._grouped(choice), axis=-1)
        if self.method != "greedy" and self.topk_group < self.n_group:
            choice = self._keep_groups(choice, group_score)
        _, ids = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)  # the unbiased scores (V3's bias: selection only)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return ids.astype(jnp.int32), weights * self.routed_scaling_factor

    def _group_size(self, x: jax.Array) -> int:
        return x.shape[-1] // self.n_group

    def _grouped(self, x: jax.Array) -> jax.Array:
        """[T, E] -> [T, n_group, E / n_group] (the experts' groups are contiguous, as DeepSeek's)."""
        return x.reshape(x.shape[0], self.n_group, self._group_size(x))

    def _keep_groups(self, choice: jax.Array, group_score: jax.Array) -> jax.Array:
        """`choice` with the experts outside the topk_group best groups at -inf (never chosen)."""
        _, keep = jax.lax.top_k(group_score, self.topk_group)  # [T, topk_group]
        kept = jnp.zeros(group_score.shape, bool).at[jnp.arange(group_score.shape[0])[:, None], keep].set(True)
        mask = jnp.repeat(kept, self._group_size(choice), axis=-1)  # [T, E]
        return jnp.where(mask, choice, -jnp.inf)
