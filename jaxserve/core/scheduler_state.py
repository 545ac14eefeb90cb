"""The scheduler's state and the helpers its three passes share (core/scheduler.py puts them together).

    Scheduler = Admission (admission.py)      waiting -> running: new prompts, prefix-cache hits, LoRA slots
              + Preemption (preemption.py)     running keep going or are preempted; swapped come back
              + StepUpdate (scheduler_update.py)  a step's results -> tokens, ends, freed blocks
    all on SchedulerState (here): the queues, the KV cache manager, the step being scheduled

Every unfinished request is in `requests` and in exactly one of `waiting` (FCFS deque), `running`
and `swapped` (both sorted oldest first by `_order`), or `pending_forks` (parallel samples waiting
for their parent's prompt KV). `_add_scheduled` is the one place a request joins a step: it writes
the ScheduledRequest, advances `num_computed_tokens` as if the step were done (so the next
schedule() may run before its update), and records the request in `_in_flight` until `update()`.
Parallel samples (`parent_id`) fork off the parent once its prompt is computed: they share its
prompt blocks and recompute only the last prompt token (copy-on-write on the shared last block),
sampling their own first token. Pure Python, no JAX.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from jaxserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import RequestUpdate, ScheduledRequest, SchedulerConfig, SchedulerOutput
from jaxserve.core.structured_output import StructuredOutputManager


class SchedulerState:
    """The queues, counters and KV cache manager of a Scheduler, with the helpers its passes share."""

    def __init__(self, config: SchedulerConfig, structured: StructuredOutputManager | None = None) -> None:
        self.config, self.structured = config, structured or StructuredOutputManager(None, 0)  # grammars
        self.kv = KVCacheManager(config.num_blocks, config.block_size,
                                 config.enable_prefix_caching, config.num_cpu_blocks)
        if config.kv_groups is not None and len(config.kv_groups) > 1:
            self.kv = HybridKVCacheManager(list(config.kv_groups), config.num_blocks, config.block_size,
                                           config.enable_prefix_caching, config.num_cpu_blocks)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted oldest first
        self.swapped: list[Request] = []  # sorted oldest first
        self.pending_forks: dict[str, list[Request]] = {}  # parent id -> samples to fork
        # (arrival_time, admission number): a total order, ties broken by add order.
        self._order: dict[str, tuple[float, int]] = {}
        self._num_added = 0
        self._admitted: set[str] = set()  # ids admitted at least once (num_cached_tokens)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._in_flight: dict[int, list[Request]] = {}  # id(SchedulerOutput) -> its requests, until update
        self._ended_unscheduled: list[RequestUpdate] = []  # aborted at admission (grammar), for update()
        self._step_max_seqs = config.max_num_seqs  # requests the step being scheduled may take
        self._step_loras: set[int] = set()  # LoRA adapters of the step being scheduled

    # -- queues ---------------------------------------------------------------
    def _finish(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._unqueue(req)
            req.status = status
            self._release(req)
            done.append(req)
        return done

    def _unqueue(self, req: Request) -> None:
        for queue in (self.running, self.swapped, self.waiting,
                      self.pending_forks.get(req.parent_id or "", [])):
            if req in queue:
                queue.remove(req)
                return

    def _release(self, req: Request) -> None:
        """Forget a finished request that is in no queue; orphaned samples prefill alone."""
        rid = req.request_id
        self.kv.forget(rid)
        self.structured.remove(rid)
        del self.requests[rid]
        del self._order[rid]
        self._admitted.discard(rid)
        children = self.pending_forks.pop(rid, [])
        for child in reversed(children):  # they arrived with the parent: front of the queue
            self.waiting.appendleft(child)

    def _insert(self, queue: list[Request], req: Request) -> None:
        bisect.insort(queue, req, key=lambda r: self._order[r.request_id])

    # -- parallel sampling ----------------------------------------------------
    def _fork_pending(self) -> None:
        """Fork samples off parents whose prompt KV is complete and on device."""
        for parent_id, children in list(self.pending_forks.items()):
            parent = self.requests[parent_id]
            if (parent_id not in self.kv.req_to_blocks
                    or parent.num_computed_tokens < parent.num_prompt_tokens):
                continue
            while children and len(self.running) < self.config.max_num_seqs:
                child = children.pop(0)
                self.kv.fork(parent_id, child.request_id, parent.num_prompt_tokens)
                # The last prompt token is recomputed so the child gets its own logits.
                child.num_computed_tokens = parent.num_prompt_tokens - 1
                child.status = RequestStatus.RUNNING
                self._admitted.add(child.request_id)
                self._insert(self.running, child)
            if not children:
                del self.pending_forks[parent_id]

    # -- the step being scheduled ---------------------------------------------
    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute now, or 0 if it must wait for a later step."""
        num_new = req.num_tokens - num_computed
        if self.config.enable_chunked_prefill and not req.pooling:  # prefill-only: whole or not at all
            return min(num_new, budget)
        return num_new if num_new <= budget else 0

    def _room(self, out: SchedulerOutput, budget: int) -> bool:
        return budget > 0 and len(out.scheduled) < self._step_max_seqs

    def _lora_fits(self, req: Request) -> bool:
        """The request's adapter is the base model, already in this step, or has a free slot."""
        lora_id = req.lora_int_id
        return not lora_id or lora_id in self._step_loras or len(self._step_loras) < self.config.max_loras

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - sum(len(s.token_ids) for s in out.scheduled)

    def _add_scheduled(self, out: SchedulerOutput, req: Request, num_new: int, drafts: list[int] = ()) -> None:
        start = req.num_computed_tokens
        params = req.sampling_params
        out.scheduled.append(ScheduledRequest(
            request_id=req.request_id, token_ids=req.token_ids_between(start, start + num_new) + list(drafts),
            start_pos=start,
            block_ids=list(self.kv.get_block_ids(req.request_id)),
            block_tables=self.kv.get_block_tables(req.request_id) if self.kv.num_groups > 1 else None,
            sample=start + num_new == req.num_tokens and not req.pooling, num_drafts=len(drafts),
            sampling_params=params, seed=req.seed, prompt_token_ids=req.prompt_token_ids,
            num_output_tokens=req.num_output_tokens + req.num_output_placeholders,
            output_token_ids=req.output_token_ids if params.needs_penalties else [], lora_int_id=req.lora_int_id,
            pooling=req.pooling, token_type_ids=req.token_type_ids, mm_inputs=req.mm_inputs))
        if req.lora_int_id:
            self._step_loras.add(req.lora_int_id)
        self.num_prompt_tokens += max(0, min(start + num_new, req.num_prompt_tokens) - start)
        # The step is as good as done for the next schedule(): its KV will be on the device first.
        req.num_computed_tokens = start + num_new
        if out.scheduled[-1].sample:
            req.num_output_placeholders += 1
            req.drafts_in_flight = bool(drafts)
        self._in_flight.setdefault(id(out), []).append(req)

    def _num_waiting(self) -> int:
        """Requests waiting for admission, parallel samples waiting to fork off their parent included."""
        return len(self.waiting) + sum(len(c) for c in self.pending_forks.values())
