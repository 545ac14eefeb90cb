"""Engine-wide counters for /metrics and `jaxserve bench`; per-request timings ride on RequestOutput.metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0  # fraction of device KV blocks in use, 0..1
    cpu_cache_usage: float = 0.0  # fraction of host swap blocks in use, 0..1
    prefix_cache_queries: int = 0  # cumulative, tokens
    prefix_cache_hits: int = 0  # cumulative, tokens
    num_preemptions: int = 0  # cumulative
    spec_num_drafts: int = 0  # cumulative, request-steps that carried speculative drafts
    spec_num_draft_tokens: int = 0  # cumulative, draft tokens proposed
    spec_num_accepted_tokens: int = 0  # cumulative, draft tokens accepted
    num_prompt_tokens: int = 0  # cumulative, tokens computed for prompts
    num_generation_tokens: int = 0  # cumulative, tokens sampled
    num_compilations: int = 0  # XLA compilations since start-up
    num_compilations_after_warmup: int = 0
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
