"""Continuous-batching scheduler, vLLM V1 style: no prefill or decode phase.

Every request has `num_computed_tokens` (KV in cache) and `num_tokens`
(prompt + outputs); a step computes some of the gap. `schedule()` spends a
token budget over at most `max_num_seqs` requests, in three passes:

    1. running  (oldest first)  the whole gap (1 token when decoding; a chunk
                                with chunked prefill). Out of blocks -> preempt
                                the NEWEST running request until it fits; if the
                                newest is this one, it is preempted itself.
    2. swapped  (oldest first)  swap back in when blocks allow (skipped in a
                                step that preempted). Keeps waiting ones out
                                while any stay swapped, so they cannot starve.
    3. waiting  (FCFS)          the whole prompt (recompute: prompt + outputs),
                                minus prefix-cache hits; the head blocks the
                                rest when it does not fit, so it never starves.

`update()` applies the runner's sampled tokens, checks stop conditions and
frees finished requests. Parallel samples (`parent_id`) wait until the parent's
prompt is computed, then fork: they share its prompt blocks and recompute only
the last prompt token (copy-on-write on the shared last block), sampling their
own first token. With `speculative` set, a greedy decoding request may carry
n-gram drafts after its last token (spec_decode.py); `update()` keeps those the
model agreed with and leaves `num_computed_tokens` short of the rest (their KV
slots are written again later). With steps in flight (async scheduling, pipeline
stages), core/in_flight.py says what may be scheduled.

LoRA (`max_loras` > 0): a step carries requests of at most max_loras distinct adapters
(the runner's device slots; the base model, id 0, takes none). Running requests of another
adapter sit the step out (the oldest go first, so the set changes as they finish); a
waiting request whose adapter does not fit is passed over, and from then on only
base-model requests are admitted past it, so the adapters in the step drain and it is
never starved.

Prefill-only requests (`Request.pooling`: embeddings, scores) take their whole prompt in one step
(never chunked, no prefix cache), sample nothing, and finish in that step's `update()` with the
runner's pooled row, releasing whatever blocks they took. On a padded-[B, S] runner
(`padded_batching`: the pooling runner, attention inside the step) they take no blocks at all, and
the waiting ones are packed by length instead of FCFS (core/prefill_only.py: the oldest's run goes
first). Pure Python, no JAX.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Iterable

from jaxserve.core import in_flight, prefill_only
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import (ModelOutput, RequestUpdate, SampledToken, ScheduledRequest,
                                            SchedulerConfig, SchedulerOutput, SchedulerStats)
from jaxserve.core.spec_decode import accept_tokens, draft_budget, draft_share, propose_drafts
from jaxserve.core.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

__all__ = ["ModelOutput", "RequestUpdate", "SampledToken", "ScheduledRequest", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SchedulerStats"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, structured: StructuredOutputManager | None = None) -> None:
        self.config, self.structured = config, structured or StructuredOutputManager(None, 0)  # grammars
        self.kv = KVCacheManager(config.num_blocks, config.block_size,
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

    # -- admission ----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        cfg, rid = self.config, request.request_id
        num_prompt = len(request.prompt_token_ids)
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        if num_prompt == 0:
            raise ValueError("prompt must contain at least one token")
        if request.lora_int_id and not cfg.max_loras:
            raise ValueError("lora_request: LoRA is not enabled (enable_lora=True)")
        if request.pooling:
            self._check_prefill_only(request)
        else:
            self._check_generation(request)
        self.structured.add_request(rid, request.sampling_params)  # compiles its grammar, if any
        request.status = RequestStatus.WAITING
        self.kv.set_extra_key(rid, request.lora_int_id)  # the prefix cache keys blocks by adapter
        self.requests[rid] = request
        self._order[rid] = (request.arrival_time, self._num_added)
        self._num_added += 1
        parent = self.requests.get(request.parent_id) if request.parent_id else None
        if parent is not None and parent.prompt_token_ids == request.prompt_token_ids:
            self.pending_forks.setdefault(parent.request_id, []).append(request)
        else:
            self.waiting.append(request)

    def _check_generation(self, request: Request) -> None:
        cfg, num_prompt = self.config, len(request.prompt_token_ids)
        if cfg.padded_batching is not None:
            raise ValueError("runner: this engine runs pooling (prefill-only) requests only, not generation")
        if num_prompt >= cfg.max_model_len:
            raise ValueError(f"prompt is {num_prompt} tokens long but max_model_len is "
                             f"{cfg.max_model_len}; it must be shorter to leave room for output")
        # A request alone must fit the pool at its longest, or nothing could ever run it.
        max_blocks = self.kv.blocks_needed(request.max_total_tokens(cfg.max_model_len) - 1)
        if max_blocks > cfg.num_blocks:
            raise ValueError(f"prompt of {num_prompt} tokens (max_model_len {cfg.max_model_len}, "
                             f"max_tokens {request.sampling_params.max_tokens}) can grow to "
                             f"{max_blocks} KV blocks but the pool has only {cfg.num_blocks}")

    def _check_prefill_only(self, request: Request) -> None:
        """The whole prompt runs in one step: it must fit max_model_len, the step (never chunked)
        and, on a runner with KV blocks, the pool; no room for output is needed."""
        cfg, num_prompt = self.config, len(request.prompt_token_ids)
        padded = cfg.padded_batching
        longest = min(cfg.max_model_len, padded.seq_buckets[-1] if padded else
                      min(cfg.max_num_batched_tokens, cfg.num_blocks * cfg.block_size))
        if num_prompt > longest:
            raise ValueError(f"prompt is {num_prompt} tokens long but this model's maximum context length "
                             f"is {longest} tokens")
        if request.token_type_ids is not None and len(request.token_type_ids) != num_prompt:
            raise ValueError(f"token_type_ids: {len(request.token_type_ids)} of them for {num_prompt} prompt tokens")
        if request.parent_id or request.lora_int_id:
            raise ValueError("pooling: a pooling request has no parallel samples (n) and no LoRA adapter")

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self._finish(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str] | str, status: RequestStatus) -> None:
        """The engine ends requests here when a stop string matched."""
        if not status.is_finished():
            raise ValueError(f"status must be a finished status, got {status}")
        self._finish([request_ids] if isinstance(request_ids, str) else request_ids, status)

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

    def _schedule_running(self, out: SchedulerOutput) -> bool:
        """Returns True if anything was preempted."""
        budget = self.config.max_num_batched_tokens
        drafts_left = draft_budget(self.config.speculative, self.config.max_num_seqs, len(self.running),
                                   self._num_waiting() + len(self.swapped))
        preempted, i = False, 0
        while i < len(self.running) and self._room(out, budget):
            req = self.running[i]
            if not self._lora_fits(req):  # another adapter's turn: this one sits the step out
                i += 1
                continue
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget) if in_flight.may_schedule(
                req, self.config) else 0
            if num_new <= 0:
                i += 1
                continue
            share = draft_share(drafts_left, len(self.running) - i)
            drafts = propose_drafts(self.config.speculative, req, num_new, min(share, budget - num_new),
                                    self.config.max_model_len)
            if drafts and not self._room_for_drafts(req, num_new, len(drafts), len(self.running) - i - 1):
                drafts = []
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, num_new + len(drafts))
            if copies is None and drafts:  # no room for the drafts: decode plainly first
                drafts = []
                copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, num_new)
            while copies is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, num_new)
            if copies is None:
                break
            out.copy_blocks.extend(copies)
            self._add_scheduled(out, req, num_new, drafts)
            budget -= num_new + len(drafts)
            drafts_left -= len(drafts)
            i += 1
        return preempted

    def _room_for_drafts(self, req: Request, num_new: int, num_drafts: int, num_after: int) -> bool:
        """Drafts must not take blocks the running requests after this one may need this step
        (a new block each at most): a draft never causes a preemption."""
        end = req.num_computed_tokens + num_new
        extra = self.kv.blocks_needed(end + num_drafts) - self.kv.blocks_needed(end)
        return extra == 0 or self.kv.num_free_blocks - extra >= num_after

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        budget = self._budget_left(out)
        while self.swapped and self._room(out, budget) and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if req.num_output_placeholders or not self._lora_fits(req):  # (placeholders: its update comes first)
                break
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if num_new <= 0:
                break
            pairs = self.kv.swap_in(req.request_id, req.num_computed_tokens, num_new)
            if pairs is None:
                break
            self.swapped.pop(0)
            out.swap_in.extend(pairs)
            req.status = RequestStatus.RUNNING
            self._insert(self.running, req)
            self._add_scheduled(out, req, num_new)
            budget -= num_new

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        budget = self._budget_left(out)
        if self.config.padded_batching is not None:
            self._admit_padded(out, budget)
            return
        caching = self.config.enable_prefix_caching
        passed_over: list[Request] = []  # waiting requests whose adapter has no slot this step
        try:
            self._admit_waiting(out, budget, caching, passed_over)
        finally:
            self.waiting.extendleft(reversed(passed_over))

    def _admit_waiting(self, out: SchedulerOutput, budget: int, caching: bool, passed_over: list[Request]) -> None:
        while (self.waiting and self._room(out, budget) and len(self.running) < self.config.max_num_seqs
               and self.structured.rotate_compiling(self.waiting)):  # a request waits for its grammar
            req = self.waiting[0]
            if req.num_output_placeholders:  # preempted with a step in flight: its update comes first
                break
            if passed_over and req.lora_int_id or not self._lora_fits(req):
                passed_over.append(self.waiting.popleft())  # behind a passed-over one: base-model requests only
                continue
            rid = req.request_id
            error = self.structured.grammar_error(rid)
            if error is not None:  # its grammar did not compile: the request ends, the rest go on
                logger.error("request %s aborted: %s", rid, error)
                self._finish([rid], RequestStatus.FINISHED_ABORTED)
                self._ended_unscheduled.append(RequestUpdate(rid, [], "abort"))
                continue
            assert req.num_computed_tokens == 0, "waiting requests hold no KV"
            # Prompt logprobs need every prompt position computed, so such a request reads no cached prefix.
            use_cache = caching and req.sampling_params.prompt_logprobs is None and not req.pooling
            hits = self.kv.get_computed_blocks(rid, req.all_token_ids) if use_cache else []
            num_computed = len(hits) * self.config.block_size
            num_new = self._num_new_tokens(req, num_computed, budget)
            if num_new <= 0:
                break
            copies = self.kv.allocate_slots(rid, num_computed, num_new, hits)
            if copies is None:
                break
            assert not copies, "a new request shares only blocks it will not write"
            self.waiting.popleft()
            req.num_computed_tokens = num_computed
            if caching:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_computed
            if rid not in self._admitted:
                self._admitted.add(rid)
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self._insert(self.running, req)
            self._add_scheduled(out, req, num_new)
            budget -= num_new

    def _admit_padded(self, out: SchedulerOutput, budget: int) -> None:
        """A padded-[B, S] runner: the waiting prefill-only requests packed by length, the oldest's run
        first (prefill_only.pack); they take no KV blocks, the padded size counts against the budget."""
        padded = self.config.padded_batching
        # max_num_seqs bounds a step's rows: the running requests hold no blocks, only a row to come from
        # a step in flight, so the next step may be scheduled (and run) before that step's update.
        room = self._step_max_seqs - len(out.scheduled)
        if room <= 0 or not self.waiting:
            return
        window = [self.waiting.popleft() for _ in range(min(len(self.waiting), prefill_only.WINDOW_ROWS * room))]
        chosen = prefill_only.pack(window, room, budget, padded)
        taken = {id(r) for r in chosen}
        self.waiting.extendleft(reversed([r for r in window if id(r) not in taken]))
        if not chosen:
            return
        for req in chosen:
            self._admitted.add(req.request_id)
            req.status = RequestStatus.RUNNING
            self._insert(self.running, req)
            self._add_scheduled(out, req, req.num_tokens)
        out.padded_shape = padded.shape(len(chosen), max(r.num_tokens for r in chosen))

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - sum(len(s.token_ids) for s in out.scheduled)

    def _add_scheduled(self, out: SchedulerOutput, req: Request, num_new: int, drafts: list[int] = ()) -> None:
        start = req.num_computed_tokens
        params = req.sampling_params
        out.scheduled.append(ScheduledRequest(
            request_id=req.request_id, token_ids=req.token_ids_between(start, start + num_new) + list(drafts),
            start_pos=start,
            block_ids=list(self.kv.get_block_ids(req.request_id)),
            sample=start + num_new == req.num_tokens and not req.pooling, num_drafts=len(drafts),
            sampling_params=params, seed=req.seed, prompt_token_ids=req.prompt_token_ids,
            num_output_tokens=req.num_output_tokens + req.num_output_placeholders,
            output_token_ids=req.output_token_ids if params.needs_penalties else [], lora_int_id=req.lora_int_id,
            pooling=req.pooling, token_type_ids=req.token_type_ids))
        if req.lora_int_id:
            self._step_loras.add(req.lora_int_id)
        self.num_prompt_tokens += max(0, min(start + num_new, req.num_prompt_tokens) - start)
        # The step is as good as done for the next schedule(): its KV will be on the device first.
        req.num_computed_tokens = start + num_new
        if out.scheduled[-1].sample:
            req.num_output_placeholders += 1
            req.drafts_in_flight = bool(drafts)
        self._in_flight.setdefault(id(out), []).append(req)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """`victim` is already out of `running`. Swap it out, else recompute later."""
        pairs = None
        if self.config.preemption_mode == "swap":
            pairs = self.kv.swap_out(victim.request_id)
        if pairs is not None:
            out.swap_out.extend(pairs)
            victim.status = RequestStatus.SWAPPED
            self._insert(self.swapped, victim)
        else:
            self.kv.free(victim.request_id)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self.waiting.appendleft(victim)
        self.num_preemptions += 1
        out.preempted_ids.append(victim.request_id)

    # -- results ------------------------------------------------------------
    def update(self, out: SchedulerOutput, model_output: ModelOutput) -> list[RequestUpdate]:
        """Apply a step's sampled tokens: per request that sampled, the tokens it accepted and
        whether that ended it. With async scheduling the next step is already scheduled (and may
        have preempted some of these requests); results of requests finished or aborted since
        `schedule()` are dropped, so no token past a request's end reaches anyone."""
        updates, self._ended_unscheduled = self._ended_unscheduled, []
        finished: list[Request] = []
        bs = self.config.block_size
        for sched, req in zip(out.scheduled, self._in_flight.pop(id(out), [])):
            if self.requests.get(sched.request_id) is not req:
                continue
            running = req.status == RequestStatus.RUNNING
            if req.pooling:  # done in its one step; its blocks (if any) go with it below
                updates.append(self._pooled(req, model_output))
                finished.append(req)
                continue
            if sched.sample:
                req.num_output_placeholders -= 1
                accepted = self._accept(req, sched, model_output, running)
                self.num_generation_tokens += len(accepted)
                updates.append(RequestUpdate(req.request_id, accepted, req.finish_reason, req.stop_reason,
                                             req.num_cached_tokens))
                if req.is_finished:
                    finished.append(req)
            num_cached = min(req.num_computed_tokens, req.num_prompt_tokens + req.num_output_tokens)
            if self.config.enable_prefix_caching and running and num_cached // bs > sched.start_pos // bs:
                self.kv.cache_blocks(req.request_id, req.all_token_ids, num_cached)
        # Fork before freeing, so a parent that finished on its first token still lends its blocks.
        self._fork_pending()
        for req in finished:
            self._unqueue(req)
            self._release(req)
        return updates

    def _pooled(self, req: Request, model_output: ModelOutput) -> RequestUpdate:
        row = model_output.pooled.get(req.request_id)
        if row is None:  # it would sit forever with nothing left to compute
            raise RuntimeError(f"runner pooled no row for {req.request_id!r}")
        req.status = RequestStatus.FINISHED_STOPPED
        return RequestUpdate(req.request_id, [], req.finish_reason, num_cached_tokens=req.num_cached_tokens,
                             pooled=row)

    def _accept(self, req: Request, sched: ScheduledRequest, model_output: ModelOutput,
                running: bool) -> list[SampledToken]:
        """The step's sampled token and its accepted drafts appended (spec_decode.accept_tokens)."""
        token = model_output.sampled.get(req.request_id)
        if token is None:  # it would sit forever with nothing left to compute
            raise RuntimeError(f"runner sampled no token for {req.request_id!r}")
        tokens, drafts = [token], sched.token_ids[len(sched.token_ids) - sched.num_drafts:]
        if drafts:
            req.drafts_in_flight = False
            tokens += model_output.draft_sampled[req.request_id]
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += len(drafts)
        accepted = accept_tokens(req, tokens, drafts, self.config.max_model_len, running)
        self.spec_num_accepted_tokens += len(accepted) - 1
        return accepted

    # -- introspection ------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._ended_unscheduled)

    def _num_waiting(self) -> int:
        """Requests waiting for admission, parallel samples waiting to fork off their parent included."""
        return len(self.waiting) + sum(len(c) for c in self.pending_forks.values())

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
