"""The start-up log's account of the parallel layout: the mesh, each weight's spec, per-device bytes."""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding

from jaxserve.models.config import ModelConfig
from jaxserve.parallel.mesh import tensor_parallel_size
from jaxserve.parallel.specs import PartitionPlan, mesh_for, partition_plan
from jaxserve.quantization.sharding import expand_specs


def _spec_str(spec) -> str:
    return "(" + ", ".join("-" if a is None else str(a) for a in spec) + ")" if len(spec) else "replicated"


def _per_device_bytes(mesh: Mesh, plan: PartitionPlan, spec, shape: tuple[int, ...], dtype) -> int:
    shard = NamedSharding(mesh_for(mesh, spec, plan), spec).shard_shape(tuple(shape))
    return math.prod(shard) * jax.numpy.dtype(dtype).itemsize


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def sharding_summary(mesh: Mesh, cfg: ModelConfig, params: dict,
                     kv_cache: tuple[jax.ShapeDtypeStruct | jax.Array, ...] | None = None) -> str:
    """Multi-line text: mesh shape, one line per param leaf (shape, spec, bytes per device,
    and why it is replicated if it fell back), the KV pool, and the per-device totals.

    `params` / `kv_cache` may be arrays or `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`).
    """
    plan = partition_plan(cfg, tensor_parallel_size(mesh))
    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    lines = [f"mesh ({axes}) over {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)"]
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = expand_specs(plan.specs, params, tensor_parallel_size(mesh))  # quantized leaves: per field
    spec_of = dict(jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0])
    weight_bytes = 0
    for path, x in flat_params:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        spec = spec_of[path]
        nbytes = _per_device_bytes(mesh, plan, spec, x.shape, x.dtype)
        weight_bytes += nbytes
        note = f"  [{plan.notes[name]}]" if name in plan.notes else ""
        lines.append(f"  {name:<18} {str(tuple(x.shape)):<22} {_spec_str(spec):<28} "
                     f"{_mib(nbytes)}/device{note}")
    lines.append(f"weights: {_mib(weight_bytes)} per device")
    if kv_cache is not None:
        kv_bytes = sum(_per_device_bytes(mesh, plan, plan.kv_cache, c.shape, c.dtype) for c in kv_cache)
        note = f"  [{plan.notes['kv_cache']}]" if "kv_cache" in plan.notes else ""
        lines.append(f"  {'kv_cache (K, V)':<18} {str(tuple(kv_cache[0].shape)):<22} "
                     f"{_spec_str(plan.kv_cache):<28} {_mib(kv_bytes)}/device{note}")
        lines.append(f"kv cache: {_mib(kv_bytes)} per device")
    return "\n".join(lines)
