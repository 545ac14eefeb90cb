"""Placing params and the KV pool on a mesh, and jitting a step with explicit shardings.

Two ways in for weights:
  * `shard_params(params, mesh, cfg)`: device_put of arrays already loaded (tests, notebooks);
  * `place_fn(mesh, cfg)`: a callback for the loader, called once per stacked leaf with the
    host numpy array; each device receives only its own slice (`make_array_from_callback`),
    so no device ever holds a whole weight and a model larger than one device can load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_layout import pool_shapes
from jaxserve.models.llama import Params
from jaxserve.parallel.mesh import MODEL_AXIS, tensor_parallel_size
from jaxserve.quantization.qweight import is_quantized
from jaxserve.quantization.sharding import expand_specs
from jaxserve.parallel.specs import REPLICATED, PartitionPlan, mesh_for, partition_plan

# leaf path ("embed", "layers/wq", ...), host array, target dtype -> the sharded device array
PlaceFn = Callable[[str, np.ndarray, jnp.dtype], jax.Array]


@dataclass(frozen=True)
class ModelShardings:
    """NamedShardings for one engine replica: params tree, the (K, V) pool, and everything else."""
    params: dict  # same tree as llama.param_shapes(cfg), NamedSharding leaves
    kv_cache: tuple[NamedSharding, NamedSharding]
    replicated: NamedSharding  # batch inputs, sampled tokens, logits

    @classmethod
    def create(cls, mesh: Mesh, cfg: ModelConfig, params: Params | None = None) -> "ModelShardings":
        """`params`: the tree to match when it holds quantized weights (their scales shard with them)."""
        plan = partition_plan(cfg, tensor_parallel_size(mesh))
        specs = plan.specs if params is None else expand_specs(plan.specs, params, tensor_parallel_size(mesh))
        params = jax.tree.map(lambda s: _named(mesh, s, plan), specs,
                              is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        kv = _named(mesh, plan.kv_cache, plan)
        return cls(params, (kv, kv), NamedSharding(mesh, REPLICATED))


def _named(mesh: Mesh, spec: jax.sharding.PartitionSpec, plan: PartitionPlan) -> NamedSharding:
    return NamedSharding(mesh_for(mesh, spec, plan), spec)


def kv_cache_sharding(mesh: Mesh, cfg: ModelConfig) -> NamedSharding:
    """The sharding of each of K and V: kv-head axis over "model" when divisible, over the kv mesh
    when the kv heads are fewer than the model axis (replicated groups), else replicated."""
    plan = partition_plan(cfg, tensor_parallel_size(mesh))
    return _named(mesh, plan.kv_cache, plan)


def shard_params(params: Params, mesh: Mesh, cfg: ModelConfig) -> Params:
    """device_put every leaf with its NamedSharding (params already in memory). A quantized weight
    split over the model axis is told how (`QuantizedWeight.split`), for its kernel's shard_map."""
    placed = jax.device_put(params, ModelShardings.create(mesh, cfg, params).params)
    return jax.tree.map(_with_split, placed, is_leaf=is_quantized)


def _with_split(leaf):
    if not is_quantized(leaf):
        return leaf
    sharding = leaf.values.sharding
    dims = tuple(sharding.spec) + (None,) * (leaf.values.ndim - len(tuple(sharding.spec)))
    kind = "column" if dims[-1] == MODEL_AXIS else "row" if dims[-2] == MODEL_AXIS else None
    return leaf if kind is None else dataclasses.replace(leaf, split=(sharding.mesh, MODEL_AXIS, kind))


def make_sharded_kv_cache(mesh: Mesh, cfg: ModelConfig, num_blocks: int, block_size: int,
                          dtype: jnp.dtype, num_layers: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The zeroed pool (like attention.make_kv_cache), created directly in its shards; num_layers: the
    pool's layer axis when not the model's (KV groups of k layers, worker/kv_groups.py)."""
    sharding = kv_cache_sharding(mesh, cfg)  # MLA's latent pool: replicated (parallel/specs.py)
    zeros = jax.jit(lambda shape: jnp.zeros(shape, dtype), static_argnums=0, out_shardings=sharding)
    k, v = (zeros(shape) for shape in pool_shapes(cfg, num_blocks, block_size, num_layers or cfg.num_layers))
    return k, v


def place_fn(mesh: Mesh, cfg: ModelConfig) -> PlaceFn:
    """A loader callback: (leaf path, host array, dtype) -> array laid out in its shards.

    Each device's slice is cut from the host array and cast on the host, then copied
    to that device only; the full array never exists on any one device.
    """
    shardings = ModelShardings.create(mesh, cfg).params

    def place(path: str, host: np.ndarray, dtype: jnp.dtype) -> jax.Array:
        node = shardings
        for key in path.split("/"):
            node = node[key]
        np_dtype = np.dtype(dtype)
        return jax.make_array_from_callback(host.shape, node, lambda idx: np.asarray(host[idx], np_dtype))

    return place


def place_params(host_params: dict, mesh: Mesh, cfg: ModelConfig, dtype: jnp.dtype) -> Params:
    """`place_fn` over a whole tree of host (numpy) arrays."""
    place = place_fn(mesh, cfg)
    flat = jax.tree_util.tree_flatten_with_path(host_params)[0]
    placed = {"/".join(str(k.key) for k in path): place("/".join(str(k.key) for k in path), np.asarray(x), dtype)
              for path, x in flat}
    return _unflatten(placed)


def _unflatten(flat: dict[str, jax.Array]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out


def jit_sharded_step(step: Callable, shardings: ModelShardings, num_outputs: int = 1) -> Callable:
    """jit `step(params, kv_cache, batch) -> (kv_cache, *outputs)` with explicit shardings.

    Params and the pool keep their shardings in and out; `batch` (any pytree) and
    the `num_outputs` other outputs are replicated over the mesh; the pool is
    donated so each layer's cache write is in place. XLA's SPMD partitioner
    inserts the collectives: no hand-written all-reduce.
    """
    return jax.jit(step, in_shardings=(shardings.params, shardings.kv_cache, shardings.replicated),
                   out_shardings=(shardings.kv_cache,) + (shardings.replicated,) * num_outputs,
                   donate_argnums=1)
