"""EngineConfig: `EngineArgs` resolved once, and the scheduler's and the runner's parts derived from it.

Every value the engine derives from the flags is computed here, in one place,
and returned (nothing is written back into EngineArgs):

    EngineConfig.resolve(args, max_position_embeddings, platform)
        max_model_len           the flag, or the model's context capped at CPU_MAX_MODEL_LEN on CPU
        max_num_batched_tokens  the flag, or min(512, max_model_len) with chunked prefill, else max_model_len
                                (both defaults from worker/sizing.py, shared with `jaxserve plan`)
        attention_backend       auto/reference resolved to xla or pallas
        block_size              the flag, or the platform's default: 64 on CPU, 16 elsewhere
        kv_cache_dtype          the flag, or the platform's default: bfloat16 on CPU, auto elsewhere
        platform_defaults       what the platform chose of these because the flag was not set, and why
        speculative             the speculative_config dict parsed, or the platform's default: n-gram drafts
                                (k = 4) on one CPU device, none elsewhere; '{}' turns it off
        async_scheduling        the flag, or on for accelerators (one host), off on CPU
        bf16_dots_from          --dtype auto on one CPU device with bfloat16 dot instructions: steps of
                                64+ tokens take bfloat16 dots (float32 weights and accumulation;
                                llama.run_layers), and so does the sampler's LM head in every step
                                (programs._sample_step's head_dots); 0 elsewhere
    config.with_blocks(num_gpu_blocks, num_cpu_blocks)   after KV sizing (profiling on GPU)
    config.scheduler_config() -> SchedulerConfig,  config.runner_config() -> RunnerConfig
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from jaxserve.constants import resolve_attention_backend
from jaxserve.core.scheduler_output import SchedulerConfig
from jaxserve.core.spec_decode import SpeculativeConfig
from jaxserve.engine.args import EngineArgs
from jaxserve.worker import batch_invariant, sizing
from jaxserve.worker.sizing import CHUNKED_PREFILL_TOKENS  # noqa: F401  (re-exported: the default's name)
from jaxserve.worker.kv_groups import KVLayout
from jaxserve.worker.model_runner import RunnerConfig


@dataclass(frozen=True)
class EngineConfig:
    args: EngineArgs
    max_model_len: int
    max_num_batched_tokens: int
    attention_backend: str  # "xla" or "pallas"
    block_size: int = sizing.ACCELERATOR_BLOCK_SIZE
    kv_cache_dtype: str = sizing.ACCELERATOR_KV_CACHE_DTYPE
    platform_defaults: tuple[str, ...] = ()  # "flag value" for each default the platform picked
    speculative: SpeculativeConfig | None = None
    async_scheduling: bool = False  # the flag, or on for accelerators with one host, off on CPU
    bf16_dots_from: int = 0  # steps of this many tokens or more take bfloat16 dots; 0: never
    num_gpu_blocks: int = 0  # 0 until with_blocks(): the KV pool is sized after the model is loaded
    num_cpu_blocks: int = 0  # the host swap pool (preemption_mode="swap")
    batch_invariant: bool = False  # --batch-invariant or VLLM_BATCH_INVARIANT=1 (worker/batch_invariant.py)
    # sliding-window KV groups (worker/kv_groups.py), set by the engine from the model; None: one table
    kv_layout: KVLayout | None = None

    @classmethod
    def resolve(cls, args: EngineArgs, max_position_embeddings: int, platform: str) -> "EngineConfig":
        """`platform`: jax.default_backend() ("cpu", "gpu", "tpu")."""
        # worker/sizing.py's defaults: `jaxserve plan` sizes with the same ones
        max_model_len = args.max_model_len or sizing.default_max_model_len(max_position_embeddings, platform == "cpu")
        default_tokens = sizing.default_max_num_batched_tokens(max_model_len, args.enable_chunked_prefill)
        on_cpu = platform == "cpu"
        block_size = args.block_size or sizing.default_block_size(on_cpu)
        kv_cache_dtype = args.kv_cache_dtype or sizing.default_kv_cache_dtype(on_cpu)
        default_drafts = args.speculative_config is None and on_cpu and _one_device(args)
        speculative = sizing.CPU_SPECULATIVE_CONFIG if default_drafts else args.speculative_config
        chosen = [f"--{flag} {value}" for flag, given, value in (
            ("block-size", args.block_size, block_size), ("kv-cache-dtype", args.kv_cache_dtype, kv_cache_dtype))
            if given is None and on_cpu]
        if default_drafts:
            chosen.append(f"--speculative-config '{json.dumps(speculative)}'")
        bf16_dots_from = default_bf16_dots_from(args, platform)
        invariant = batch_invariant.enabled(args.batch_invariant)
        backend = resolve_attention_backend(args.attention_backend, platform)
        if invariant and batch_invariant.refusal(args, backend):
            raise ValueError(batch_invariant.refusal(args, backend))
        if invariant and bf16_dots_from:  # every bucket is past it: every step takes them
            bf16_dots_from = min(bf16_dots_from, batch_invariant.MIN_ROWS)
        if bf16_dots_from:
            chosen.append(f"--dtype auto (float32 weights, bfloat16 dots in steps of {bf16_dots_from}+ tokens)")
        return cls(args=args, max_model_len=max_model_len,
                   max_num_batched_tokens=args.max_num_batched_tokens or default_tokens,
                   attention_backend=backend, batch_invariant=invariant,
                   block_size=block_size, kv_cache_dtype=kv_cache_dtype, platform_defaults=tuple(chosen),
                   speculative=SpeculativeConfig.parse(speculative),
                   async_scheduling=_async_scheduling(args, on_cpu), bf16_dots_from=bf16_dots_from)

    @property
    def min_blocks(self) -> int:
        """The blocks one request of max_model_len needs: the smallest usable pool."""
        if self.kv_layout is not None:  # every group's table at its longest (the admission check's figure)
            return self.kv_layout.min_blocks(self.max_model_len, self.block_size)
        return -(-self.max_model_len // self.block_size)

    def with_blocks(self, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> "EngineConfig":
        return dataclasses.replace(self, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks)

    def scheduler_config(self) -> SchedulerConfig:
        a = self.args
        return SchedulerConfig(
            num_blocks=self.num_gpu_blocks, block_size=self.block_size, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_chunked_prefill=a.enable_chunked_prefill, enable_prefix_caching=a.enable_prefix_caching,
            preemption_mode=a.preemption_mode, num_cpu_blocks=self.num_cpu_blocks, speculative=self.speculative,
            pipeline_depth=a.pipeline_parallel_size if self.async_scheduling else 1,
            max_loras=a.max_loras if a.enable_lora else 0,
            kv_groups=self.kv_layout.groups if self.kv_layout is not None else None)

    @property
    def max_steps_in_flight(self) -> int:
        """Steps issued and not yet read back: 1 synchronous; async scheduling keeps one on the device
        while the next is scheduled; P pipeline stages keep P (disjoint requests), one per stage."""
        return max(2, self.args.pipeline_parallel_size) if self.async_scheduling else 1

    def runner_config(self) -> RunnerConfig:
        a = self.args
        return RunnerConfig(
            num_blocks=self.num_gpu_blocks, block_size=self.block_size, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            backend=self.attention_backend, num_cpu_blocks=self.num_cpu_blocks, kv_cache_dtype=self.kv_cache_dtype,
            bf16_dots_from=self.bf16_dots_from, logprobs_mode=a.logprobs_mode,
            head_float32=a.head_dtype == "float32", batch_invariant=self.batch_invariant, kv_layout=self.kv_layout)


def default_bf16_dots_from(args: EngineArgs, platform: str) -> int:
    """EngineConfig.bf16_dots_from: --dtype auto on one CPU device with bfloat16 dot instructions."""
    return sizing.default_bf16_dots_from(platform == "cpu") if args.dtype == "auto" and _one_device(args) else 0


def _one_device(args: EngineArgs) -> bool:
    """The CPU's n-gram and bfloat16-dot defaults are measured on one device (BENCHMARKS.md); parallel
    runs keep neither."""
    return (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size, args.num_hosts) == (1, 1, 1, 1)


def _async_scheduling(args: EngineArgs, on_cpu: bool) -> bool:
    """Off on CPU, where host and "device" share the same cores (BENCHMARKS.md); on elsewhere."""
    if args.async_scheduling is None:
        return not on_cpu and args.num_hosts == 1
    if args.async_scheduling and args.num_hosts > 1:
        # Every rank must read the sampled ids (a collective) at the same point of the step order.
        raise ValueError("async_scheduling: not supported with num_hosts > 1; use --no-async-scheduling")
    return args.async_scheduling
