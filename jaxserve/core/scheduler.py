"""Continuous-batching scheduler, vLLM V1 style: no prefill or decode phase.

Every request has `num_computed_tokens` (KV in cache) and `num_tokens` (prompt + outputs); a step
computes some of the gap. `schedule()` spends a token budget over at most `max_num_seqs` requests,
in three passes, then `update()` applies the step's results:

    1. running  (oldest first)  the whole gap; out of blocks -> preempt the newest   preemption.py
    2. swapped  (oldest first)  swap back in when blocks allow (not after a preemption)  preemption.py
    3. waiting  (FCFS)          the whole prompt minus prefix-cache hits             admission.py
    update(out, model_output)   tokens accepted, stop checks, finished freed         scheduler_update.py

The state the passes share (queues, KV cache manager, the step being scheduled, parallel-sample
forks) is scheduler_state.py's; each module's docstring says its part: LoRA's adapter slots,
prefill-only (pooling) requests, speculative drafts, steps in flight (core/in_flight.py). This
module puts them together and is what the engine imports. Pure Python, no JAX.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.core import in_flight
from jaxserve.core.admission import Admission
from jaxserve.core.preemption import Preemption
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import (ModelOutput, RequestUpdate, SampledToken, ScheduledRequest,
                                            SchedulerConfig, SchedulerOutput, SchedulerStats)
from jaxserve.core.scheduler_update import StepUpdate

__all__ = ["ModelOutput", "RequestUpdate", "SampledToken", "ScheduledRequest", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SchedulerStats"]


class Scheduler(Admission, Preemption, StepUpdate):
    """The queues of scheduler_state.SchedulerState, admitted by Admission, kept running (or
    preempted) by Preemption, and advanced by StepUpdate; the engine's one entry point."""

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self._finish(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str] | str, status: RequestStatus) -> None:
        """The engine ends requests here when a stop string matched."""
        if not status.is_finished():
            raise ValueError(f"status must be a finished status, got {status}")
        self._finish([request_ids] if isinstance(request_ids, str) else request_ids, status)

    # -- scheduling ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._fork_pending()
        self._step_max_seqs = in_flight.seqs_this_step(self.config, self.running,
                                                      self._num_waiting() + len(self.swapped), len(self._in_flight))
        out = SchedulerOutput()
        self._step_loras = set()
        preempted = self._schedule_running(out)
        if not preempted:
            self._schedule_swapped(out)
            if not self.swapped:
                self._schedule_waiting(out)
        out.num_batched_tokens = sum(len(s.token_ids) for s in out.scheduled)
        return out

    # -- introspection ------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._ended_unscheduled)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> SchedulerStats:
        counters = {name: getattr(self, name) for name in (
            "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "spec_num_drafts", "spec_num_draft_tokens",
            "spec_num_accepted_tokens", "num_prompt_tokens", "num_generation_tokens")}
        waiting = list(self.waiting) + [r for c in self.pending_forks.values() for r in c] + self.swapped
        return SchedulerStats(
            num_running=len(self.running), num_swapped=len(self.swapped),
            num_waiting=self._num_waiting(),
            running_lora_ids=tuple(sorted({r.lora_int_id for r in self.running if r.lora_int_id})),
            waiting_lora_ids=tuple(sorted({r.lora_int_id for r in waiting if r.lora_int_id})),
            kv_cache_usage=self.kv.usage, cpu_cache_usage=self.kv.cpu_usage, **counters)
