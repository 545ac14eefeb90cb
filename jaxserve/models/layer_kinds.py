"""Models that mix dense and MoE layers (DeepSeek's first_k_dense_replace / moe_layer_freq,
Qwen2/3-MoE's mlp_only_layers / decoder_sparse_step): each layer holds only its own kind's weights.

The layer-wide leaves (attention, norms, the `sparse` flag) are stacked over all L layers as in
any model; a kind's own leaves only over that kind's layers:

    dense leaves  w_gate, w_up, w_down   [L_dense, ...]
    MoE leaves    router, e_bias, we_*, ws_*   [L_sparse, ...]

so DeepSeek-V3 holds no zero MLP in its 58 sparse layers and no zero experts in its 3 dense ones
(the earlier form: ~114 GB of zeros in bfloat16, 46 GB of MLPs and 68 GB of experts). The layer
scan keeps one body: the kind-local stacks ride along whole (not as scanned xs, whose leading
axes must all be L) and a layer's branch of the `lax.cond` reads its own row at its index among
its kind (`kind_index`, from the cumulative count of the `sparse` flag, so a pipeline stage's
slice of the layers computes its own). Only the branch that runs reads its weights; the expert
stacks stay whole as LayerStacks at that row (models/expert_weights.py), as they always were.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig

DENSE_LEAVES = ("w_gate", "w_up", "w_down", "w_gate_up")
MOE_LEAVES = ("router", "e_bias", "we_gate", "we_up", "we_down")
KIND_INDEX = "kind_index"  # in a layer's lp: its row in its own kind's stacks


def kind_of(leaf: str) -> str | None:
    """"dense", "moe", or None for a leaf every layer has."""
    if leaf in DENSE_LEAVES:
        return "dense"
    if leaf in MOE_LEAVES or leaf.startswith("ws_"):
        return "moe"
    return None


def is_mixed(cfg: ModelConfig) -> bool:
    return cfg.moe is not None and bool(cfg.moe.dense_layers)


def leaf_layers(cfg: ModelConfig, leaf: str) -> tuple[int, ...]:
    """The layers (global ids) whose rows a leaf stacks."""
    kind = kind_of(leaf) if is_mixed(cfg) else None
    if kind is None:
        return tuple(range(cfg.num_layers))
    dense = set(cfg.moe.dense_layers)
    return tuple(i for i in range(cfg.num_layers) if (i in dense) == (kind == "dense"))


def leaf_rows(cfg: ModelConfig, leaf: str, start: int, end: int) -> tuple[int, int]:
    """The rows [a, b) of a leaf's stack that hold layers [start, end) (a pipeline stage's)."""
    ids = leaf_layers(cfg, leaf)
    return sum(i < start for i in ids), sum(i < end for i in ids)


def stack_shapes(cfg: ModelConfig, layers: dict) -> dict:
    """param_shapes' `layers` with each kind-local leaf's leading axis its kind's layer count."""
    if not is_mixed(cfg):
        return layers
    return {k: (len(leaf_layers(cfg, k)), *v[1:]) if kind_of(k) else v for k, v in layers.items()}


def stage_config(cfg: ModelConfig, start: int, end: int) -> ModelConfig:
    """A pipeline stage's config: layers [start, end), its dense layers renumbered from 0."""
    out = dataclasses.replace(cfg, num_layers=end - start)
    if cfg.moe is not None and cfg.moe.dense_layers:
        dense = tuple(i - start for i in cfg.moe.dense_layers if start <= i < end)
        out = dataclasses.replace(out, moe=dataclasses.replace(cfg.moe, dense_layers=dense))
    return out


def slice_layers(cfg: ModelConfig, layers: dict, start: int, end: int) -> dict:
    """A stage's rows of every layer leaf (kind-local leaves: their own kind's rows)."""
    out = {}
    for k, v in layers.items():
        a, b = leaf_rows(cfg, k, start, end) if kind_of(k) and "sparse" in layers else (start, end)
        out[k] = jax.tree.map(lambda x, a=a, b=b: x[a:b], v)
    return out


def split_scanned(layers: dict) -> tuple[dict, dict, jax.Array | None]:
    """(the leaves scanned per layer, the kind-local stacks, each layer's kind_index [n] i32 or None).
    A model without the `sparse` flag has no kind-local leaves: everything is scanned."""
    if "sparse" not in layers:
        return layers, {}, None
    local = {k: v for k, v in layers.items() if kind_of(k)}
    sparse = (layers["sparse"] > 0).astype(jnp.int32)
    index = jnp.where(sparse > 0, jnp.cumsum(sparse) - sparse, jnp.cumsum(1 - sparse) - (1 - sparse))
    return {k: v for k, v in layers.items() if k not in local}, local, index


def own_rows(lp: dict, kind: str) -> dict:
    """lp with its `kind` leaves at this layer's row (the expert stacks stay LayerStacks)."""
    if KIND_INDEX not in lp:
        return lp
    i = lp[KIND_INDEX]
    return {**lp, **{k: jax.tree.map(lambda a: a[i], v) for k, v in lp.items()
                     if kind_of(k) == kind and not k.startswith("we_")}}


def mixed_ffn(cfg: ModelConfig, lp: dict, x: jax.Array, sparse: Callable, dense: Callable) -> jax.Array:
    """The layer's feed-forward block: sparse(lp, x) or dense(lp, x), each given its own rows; one
    `lax.cond` where the (stage's) layers mix both kinds."""
    m = cfg.moe
    if not m.dense_layers:
        return sparse(own_rows(lp, "moe"), x)
    if len(m.dense_layers) == cfg.num_layers:
        return dense(own_rows(lp, "dense"), x)
    return jax.lax.cond(lp["sparse"] > 0, lambda x: sparse(own_rows(lp, "moe"), x),
                        lambda x: dense(own_rows(lp, "dense"), x), x)
