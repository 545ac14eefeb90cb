"""Engine-wide counters for /metrics and `jaxserve bench`; per-request timings ride on RequestOutput.metrics."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.scheduler_output import SchedulerStats


@dataclass(frozen=True)
class EngineStats(SchedulerStats):
    """The scheduler's counters (queues, KV usage, prefix cache, preemptions, speculative and
    token counts) plus what only the engine knows."""

    num_compilations: int = 0  # XLA compilations since start-up
    num_compilations_after_warmup: int = 0
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    # vLLM's vllm:lora_requests_info: the adapters' names (running_lora_ids / waiting_lora_ids), the slots
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
