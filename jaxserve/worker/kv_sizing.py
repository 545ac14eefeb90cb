"""How many KV blocks the pool gets: an explicit count, a byte budget on CPU, or a
fraction of device memory minus the weights and the measured activation peak (the arithmetic is
worker/sizing.py's, shared with `jaxserve plan`). The engine passes the flags it resolved as plain
values: this layer does not know the engine's arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve import parallel
from jaxserve.worker import sizing
from jaxserve.worker.sizing import kv_budget

DEFAULT_CPU_KV_BYTES = 1 << 30


def device_memory_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def accelerator_memory_bytes() -> int | None:
    """The device's memory on an accelerator; None on the CPU (the pool is --kv-cache-memory there)."""
    return device_memory_bytes() if jax.default_backend() != "cpu" else None


def needs_profile(num_gpu_blocks_override: int | None) -> bool:
    """Only sizing by --gpu-memory-utilization on an accelerator needs the activation dry run."""
    return num_gpu_blocks_override is None and jax.default_backend() != "cpu" \
        and device_memory_bytes() is not None


def refuse_oversized_weights(cfg, width: int, *, tensor_parallel_size: int, pipeline_parallel_size: int,
                             quantization: str | None, max_model_len: int | None,
                             max_num_batched_tokens: int | None, enable_chunked_prefill: bool, max_num_seqs: int,
                             gpu_memory_utilization: float, lora_bytes: int = 0) -> None:
    """Before loading anything: on an accelerator, ValueError (sizing.kv_budget's, with the numbers)
    when the weights this configuration puts on one device (LoRA slots, `lora_bytes`, included) plus
    the estimated activation reserve exceed --gpu-memory-utilization of it -- instead of an
    out-of-memory error halfway through the load."""
    total = accelerator_memory_bytes()
    if total is None:
        return
    tp = tensor_parallel_size
    weights = sizing.weight_bytes_per_device(cfg, width, tp, pipeline_parallel_size, quantization) + lora_bytes
    max_len = max_model_len or sizing.default_max_model_len(cfg.max_position_embeddings, False)
    tokens = max_num_batched_tokens or sizing.default_max_num_batched_tokens(max_len, enable_chunked_prefill)
    kv_budget(total, gpu_memory_utilization, weights,
              sizing.activation_bytes_estimate(cfg, tokens, max_num_seqs, width, tp))


def num_device_blocks(bytes_per_block: int, weight_bytes: int, activation_bytes: int, min_blocks: int, *,
                      num_gpu_blocks_override: int | None, gpu_memory_utilization: float,
                      kv_cache_memory: int | None) -> int:
    """min_blocks: what one request of max_model_len needs; fewer is refused with a clear error.
    weight_bytes: everything allocated with the weights (LoRA slots included); activation_bytes: the
    largest bucket's temporary memory, from a compiled dry run."""
    total = accelerator_memory_bytes()
    if total is not None:  # refuse weights + activations over the allowed share, whatever sets the pool
        budget = kv_budget(total, gpu_memory_utilization, weight_bytes, activation_bytes)
    if num_gpu_blocks_override is not None:
        blocks = num_gpu_blocks_override
        source = "--num-gpu-blocks-override"
    else:
        if total is None:
            budget = kv_cache_memory or DEFAULT_CPU_KV_BYTES
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
