"""Tensor and data parallelism over one `jax.sharding.Mesh` with axes ("data", "model").

    mesh = make_mesh(tensor_parallel_size, data_parallel_size)        # validate + build
    shardings = ModelShardings.create(replica_mesh, cfg)              # per replica
    params = shard_params(params, replica_mesh, cfg)   or   place_fn(...) inside the loader
    kv = make_sharded_kv_cache(replica_mesh, cfg, num_blocks, block_size, dtype)
    step = jit_sharded_step(step_fn, shardings, num_outputs=2)
    log.info(sharding_summary(replica_mesh, cfg, params, kv))
"""

from jaxserve.parallel.mesh import (
    AXIS_NAMES,
    DATA_AXIS,
    MODEL_AXIS,
    check_parallel_config,
    make_mesh,
    replica_meshes,
    tensor_parallel_size,
)
from jaxserve.parallel.sharding import (
    ModelShardings,
    PlaceFn,
    jit_sharded_step,
    kv_cache_sharding,
    make_sharded_kv_cache,
    place_fn,
    place_params,
    shard_params,
)
from jaxserve.parallel.specs import (
    KV_HEADS_AXIS,
    PartitionPlan,
    kv_group_mesh,
    kv_cache_partition_spec,
    param_partition_specs,
    partition_plan,
)
from jaxserve.parallel.summary import sharding_summary

__all__ = [
    "AXIS_NAMES", "DATA_AXIS", "MODEL_AXIS", "ModelShardings", "KV_HEADS_AXIS", "PartitionPlan", "PlaceFn",
    "check_parallel_config", "jit_sharded_step", "kv_cache_partition_spec", "kv_cache_sharding", "kv_group_mesh",
    "make_mesh", "make_sharded_kv_cache", "param_partition_specs", "partition_plan", "place_fn",
    "place_params", "replica_meshes", "shard_params", "sharding_summary", "tensor_parallel_size",
]
