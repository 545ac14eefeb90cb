"""One request as the scheduler sees it (generation, or prefill-only pooling): token ids and bookkeeping.

A request is a single sequence. Parallel samples (`n > 1`) are separate
requests whose `parent_id` names the first sample; the scheduler forks them
off the parent's prompt blocks (see scheduler.py). Pure Python, no JAX.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxserve.core.sampling_params import SamplingParams


# The input token of a decode step whose previous step is still on the device: the runner takes
# its value from that step's sampled ids on the device (async scheduling).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    def is_finished(self) -> bool:
        # Works both as `status.is_finished()` and `RequestStatus.is_finished(status)`.
        return self in _FINISHED

    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED})
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop",
                   RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}


# eq=False: a request is an entity; queues find and remove it by identity.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    # Set for the 2nd..nth parallel sample: the request id of the first sample.
    parent_id: str | None = None
    # The sampler's seed: SamplingParams.seed (+ the sample's index for n > 1), or one the engine
    # drew at admission. Row keys are fold_in(key(seed), output index): batch-independent.
    seed: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # known tokens (placeholders excluded)
    # Async scheduling: tokens sampled by steps still on the device. They count in num_tokens (the
    # next step's input is one, taken on the device from the step that sampled it) but not in
    # output_token_ids, which `Scheduler.update` fills when the step's results arrive.
    num_output_placeholders: int = 0
    # Async scheduling: a step that carried drafts is in flight, so how many tokens it accepts
    # (the next position) is unknown until its update: not schedulable until then.
    drafts_in_flight: bool = False
    # Tokens whose KV is in the cache (device or, while swapped, host).
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # The stop token id (or, set by the engine, the stop string) that ended it.
    stop_reason: int | str | None = None
    # Prompt tokens served by the prefix cache at the first admission.
    num_cached_tokens: int = 0
    # The LoRA adapter it runs under (LoRARequest.lora_int_id); 0: the base model. The scheduler
    # keeps at most max_loras distinct adapters in a step, and the prefix cache keys blocks by it.
    lora_int_id: int = 0
    # Prefill-only (a pooling request): one step computes the whole prompt, never chunked, and its
    # result is the pooled row (ModelOutput.pooled); no sampling, no decode, no blocks after the step.
    pooling: bool = False
    token_type_ids: list[int] | None = None  # pooling: each prompt token's segment (a text pair); None: all 0
    # a vision-language model's request with images: jaxserve.multimodal.inputs.MultiModalInputs (its
    # images' patches and placeholder spans, M-RoPE's positions); None: text only
    mm_inputs: object | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, placeholders included: the length the next step extends."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids (decode: one token); positions
        of tokens still on the device are PLACEHOLDER."""
        n = self.num_prompt_tokens
        if start >= n:
            ids = self.output_token_ids[start - n:end - n]
        elif end <= n:
            return self.prompt_token_ids[start:end]
        else:
            ids = self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
        return ids + [PLACEHOLDER] * (end - start - len(ids))

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason()

    def max_total_tokens(self, max_model_len: int) -> int:
        """The length (prompt + outputs) at which this request ends at the latest."""
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is None:
            return max_model_len
        return min(max_model_len, self.num_prompt_tokens + max_tokens)

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: set a finished status and return True if done.

        A stop token beats the length limit when both apply, so a user sees
        "stop" for an eos that happened to be the last allowed token. Stop
        strings are matched by the engine's detokenizer, not here.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        num_known = self.num_prompt_tokens + self.num_output_tokens  # an in-flight step's token is no end
        if self.num_output_tokens >= params.min_tokens:
            if last in (params.stop_token_ids or ()):
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
                return True
            if not params.ignore_eos and (last in self.eos_token_ids
                                          or last in params.eos_token_ids):
                self.status = RequestStatus.FINISHED_STOPPED
                return True
        if num_known >= self.max_total_tokens(max_model_len):
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
