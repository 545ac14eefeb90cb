"""Admission: a request enters (`add_request`, checked against the pool and max_model_len) and
waits; `schedule()`'s last pass moves waiting requests to running.

    add_request --checks--> waiting (FCFS) --_admit_waiting--> running + a ScheduledRequest
                            waiting (by length) --_admit_padded--> running (a padded [B, S] runner)

A waiting request is admitted with its whole prompt (recompute after a preemption: prompt +
outputs) minus its prefix-cache hits; the head blocks the rest when it does not fit the budget or
the pool, so it never starves. A request whose grammar is still compiling waits without blocking
others; one whose grammar failed ends here (reported by the next update()).

LoRA (`max_loras` > 0): a step carries requests of at most max_loras distinct adapters (the
runner's device slots; the base model, id 0, takes none). A waiting request whose adapter does not
fit is passed over, and from then on only base-model requests are admitted past it, so the
adapters in the step drain and it is never starved.

Prefill-only requests (`Request.pooling`: embeddings, scores) take their whole prompt in one step
(never chunked, no prefix cache). On a padded-[B, S] runner (`padded_batching`: the pooling runner,
attention inside the step) they take no blocks at all, and the waiting ones are packed by length
instead of FCFS (core/prefill_only.py: the oldest's run goes first). Pure Python, no JAX.
"""

from __future__ import annotations

import logging

from jaxserve.core import prefill_only
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import RequestUpdate, SchedulerOutput
from jaxserve.core.scheduler_state import SchedulerState

logger = logging.getLogger("jaxserve.core.scheduler")


class Admission(SchedulerState):
    """add_request and the waiting pass of schedule()."""

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
        # the prefix cache keys blocks by adapter, and by the request's images (the same placeholder
        # tokens with other images are other KV)
        mm = request.mm_inputs
        self.kv.set_extra_key(rid, request.lora_int_id if mm is None else hash((request.lora_int_id, mm.cache_key)))
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
        # (Every group at its longest: a preempted request recomputes its whole context in one step.)
        max_blocks = self.kv.blocks_needed(request.max_total_tokens(cfg.max_model_len) - 1) * self.kv.num_groups
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

    # -- waiting -> running: the last pass of schedule() ----------------------
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
