"""How many KV blocks the pool gets: an explicit count, a byte budget on CPU, or a
fraction of device memory minus the weights and the measured activation peak (the arithmetic is
worker/sizing.py's, shared with `jaxserve plan`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.engine.args import EngineArgs
from jaxserve import parallel
from jaxserve.worker import sizing
from jaxserve.worker.sizing import kv_budget

DEFAULT_CPU_KV_BYTES = 1 << 30


def device_memory_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def needs_profile(args: EngineArgs) -> bool:
    """Only sizing by --gpu-memory-utilization on an accelerator needs the activation dry run."""
    return args.num_gpu_blocks_override is None and jax.default_backend() != "cpu" \
        and device_memory_bytes() is not None


def refuse_oversized_weights(args: EngineArgs, cfg, width: int) -> None:
    """Before loading anything: on an accelerator, ValueError (sizing.kv_budget's, with the numbers)
    when the weights this configuration puts on one device plus the estimated activation reserve
    exceed --gpu-memory-utilization of it -- instead of an out-of-memory error halfway through the load."""
    total = device_memory_bytes() if jax.default_backend() != "cpu" else None
    if total is None:
        return
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    weights = sizing.weight_bytes_per_device(cfg, width, tp, pp, args.quantization)
    max_len = args.max_model_len or sizing.default_max_model_len(cfg.max_position_embeddings, False)
    tokens = args.max_num_batched_tokens or sizing.default_max_num_batched_tokens(max_len, args.enable_chunked_prefill)
    kv_budget(total, args.gpu_memory_utilization, weights,
              sizing.activation_bytes_estimate(cfg, tokens, args.max_num_seqs, width, tp))


def num_device_blocks(args: EngineArgs, bytes_per_block: int, weight_bytes: int, activation_bytes: int,
                      min_blocks: int) -> int:
    """min_blocks: what one request of max_model_len needs; fewer is refused with a clear error.
    activation_bytes: the largest bucket's temporary memory, from a compiled dry run."""
    total = device_memory_bytes() if jax.default_backend() != "cpu" else None
    if total is not None:  # refuse weights + activations over the allowed share, whatever sets the pool
        budget = kv_budget(total, args.gpu_memory_utilization, weight_bytes, activation_bytes)
    if args.num_gpu_blocks_override is not None:
        blocks = args.num_gpu_blocks_override
        source = "--num-gpu-blocks-override"
    else:
        if total is None:
            budget = args.kv_cache_memory or DEFAULT_CPU_KV_BYTES
            source = "--kv-cache-memory"
        else:
            source = "--gpu-memory-utilization"
        blocks = budget // bytes_per_block
    if blocks < min_blocks:
        raise ValueError(f"{source}: the KV pool would hold {blocks} blocks, but one request of max_model_len "
                         f"needs {min_blocks}; give it more memory or lower --max-model-len")
    return int(blocks)


def kv_bytes_per_block(cfg, block_size: int, dtype, mesh: Mesh | None = None, pipeline_parallel_size: int = 1,
                       tensor_parallel_size: int | None = None) -> int:
    """K and V bytes of one block across a stage's layers, on one device (its shard, under a mesh)."""
    tp = parallel.tensor_parallel_size(mesh) if mesh is not None else (tensor_parallel_size or 1)
    return sizing.kv_bytes_per_block(cfg, block_size, jnp.dtype(dtype).itemsize, tp, pipeline_parallel_size)
