"""Plain data crossing the scheduler <-> runner line: config, one step's plan, its results (sampled
tokens, or pooled rows for prefill-only requests).

Everything here is ints, lists and strings, so the scheduler is testable
without JAX and the runner can pack it into device arrays however it likes.
Re-exported by scheduler.py; import from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
from pydantic import Field, model_validator

from jaxserve.constants import PreemptionMode
from jaxserve.core.hybrid_kv_cache_manager import KVGroup
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.prefill_only import PaddedBatching
from jaxserve.core.spec_config import SpeculativeConfig
from jaxserve.core.validation import config_dataclass

PositiveInt = Annotated[int, Field(ge=1)]


@config_dataclass()
class SchedulerConfig:
    """The scheduler's part of the engine config (EngineConfig.scheduler_config()); plain ints in tests."""
    num_blocks: PositiveInt
    block_size: PositiveInt = 16
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 2048
    max_model_len: Annotated[int, Field(ge=2)] = 2048  # a prompt token and an output
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    preemption_mode: PreemptionMode = "recompute"
    num_cpu_blocks: Annotated[int, Field(ge=0)] = 0  # host swap pool, used by preemption_mode="swap"
    speculative: SpeculativeConfig | None = None  # n-gram drafts for greedy decoding requests
    # Pipeline stages with async scheduling: up to this many steps in flight, holding disjoint
    # requests, so that stage s runs one while stage s+1 runs the one before (vLLM keeps P batches
    # in flight). A request with a step in flight then waits for its update, and a step takes its
    # share of the runnable requests: ceil(runnable / free slots). 1: no pipeline.
    pipeline_depth: PositiveInt = 1
    # LoRA: distinct adapters one step may carry (the runner's device slots); 0: LoRA is off
    max_loras: Annotated[int, Field(ge=0)] = 0
    # A runner that runs each step as one padded [B, S] program of prefill-only requests (the pooling
    # runner: attention inside the step, no KV pool, so num_blocks is unused): its buckets. The
    # scheduler then admits only prefill-only requests, packed by length (prefill_only.pack).
    padded_batching: PaddedBatching | None = None
    # More than one KV group (hybrid_kv_cache_manager.kv_groups: sliding-window layers): one block
    # table per group, sliding groups holding their window only. None or one group: one table.
    kv_groups: tuple[KVGroup, ...] | None = None

    @model_validator(mode="after")
    def _check_together(self) -> "SchedulerConfig":
        # Without chunking a prompt is scheduled whole, so the longest one must fit a step (a padded
        # runner always runs a prompt alone, B = 1, whatever the budget).
        if (not self.enable_chunked_prefill and self.padded_batching is None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}) unless enable_chunked_prefill is on")
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise ValueError("num_cpu_blocks must be > 0 when preemption_mode is 'swap' (the host swap pool)")
        return self


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # fed this step, at positions start_pos .. start_pos + len - 1
    start_pos: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table after this step's allocation
    # True when this step computes the request's last known token, so the runner
    # samples a new token from its logits (False for a non-final prefill chunk).
    sample: bool
    # Speculative drafts: the last num_drafts of token_ids are proposed, not yet accepted. The
    # runner samples after each of them too (ModelOutput.draft_sampled).
    num_drafts: int = 0
    # What the sampler reads, so the runner never needs the live Request. The lists are the
    # request's own (not copies): the runner only reads them, during this step.
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0  # the request's seed; row j of a request samples with key(seed, num_output_tokens + j)
    prompt_token_ids: list[int] = field(default_factory=list)  # prompt logprob targets, penalties
    num_output_tokens: int = 0  # before this step: the sampling step index and min_tokens
    output_token_ids: list[int] = field(default_factory=list)  # the penalties' history
    lora_int_id: int = 0  # the request's LoRA adapter (LoRARequest.lora_int_id); 0: the base model
    pooling: bool = False  # prefill-only: the runner returns the pooled row (ModelOutput.pooled), samples nothing
    token_type_ids: list[int] | None = None  # pooling: the prompt tokens' segments; None: all 0
    # With several KV groups (SchedulerConfig.kv_groups): each group's table, block_ids being the first
    # (a full-attention group's); a sliding group's slots outside its window read block 0. None: one group.
    block_tables: list[list[int]] | None = None
    mm_inputs: object | None = None  # the request's images (Request.mm_inputs; jaxserve/multimodal); None: none


@dataclass
class SchedulerOutput:
    """One step's plan. The runner applies the block moves BEFORE the forward, in
    this order: swap_out, swap_in, copy_blocks (a block freed by a swap-out may
    be reused as a copy destination in the same step)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # order in the flat batch
    num_batched_tokens: int = 0
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    preempted_ids: list[str] = field(default_factory=list)
    # [sampling rows, W] i32 token bitmask (structured outputs, allowed_token_ids, bad_words), one row
    # per sampled row in `scheduled` order (k drafts: k + 1 rows); None: no row is constrained
    token_bitmask: np.ndarray | None = None
    # SchedulerConfig.padded_batching: the (B, S) program this step's requests run in; None otherwise
    padded_shape: tuple[int, int] | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in or self.copy_blocks)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    rank: int | None = None


@dataclass
class ModelOutput:
    # request_id -> token, only for the ScheduledRequests with sample=True
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # request_id -> the token sampled after each of its drafts, for ScheduledRequests with num_drafts > 0
    draft_sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request_id -> {prompt position p: logprob entry for prompt token p (p >= 1)}, for prompt_logprobs
    prompt_logprobs: dict[str, dict[int, SampledToken]] = field(default_factory=dict)
    # request_id -> its pooled row [D] (embedding, or classifier logits), for ScheduledRequests with pooling
    pooled: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """What one scheduled request gained in a step, returned by `Scheduler.update`: the tokens
    accepted (one, or more with accepted drafts; none for a prefill chunk) with their logprobs,
    and how it ended when it did. The scheduler's Request is the one owner of output tokens;
    everything downstream reads them from here."""

    request_id: str
    new_tokens: list[SampledToken]
    finish_reason: str | None = None  # "stop" / "length" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at admission
    pooled: np.ndarray | None = None  # a pooling request's row [D] (it is finished with it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0  # includes parallel samples waiting to fork off their parent
    num_swapped: int = 0
    kv_cache_usage: float = 0.0  # fraction of device blocks referenced, 0..1
    cpu_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative, tokens looked up at admission
    prefix_cache_hits: int = 0  # cumulative, tokens found
    num_preemptions: int = 0  # cumulative
    spec_num_drafts: int = 0  # cumulative, request-steps that carried drafts
    spec_num_draft_tokens: int = 0  # cumulative
    spec_num_accepted_tokens: int = 0  # cumulative, drafts the model agreed with
    num_prompt_tokens: int = 0  # cumulative, prompt tokens computed (recomputes included)
    num_generation_tokens: int = 0  # cumulative, output tokens accepted
    running_lora_ids: tuple[int, ...] = ()  # LoRA adapters of the running requests
    waiting_lora_ids: tuple[int, ...] = ()  # LoRA adapters of the waiting requests
