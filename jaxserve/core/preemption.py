"""The running requests' pass of `schedule()`, preemption, and the swapped requests' way back.

    running (oldest first) --the whole gap (1 token decoding; a chunk with chunked prefill)--> step
        out of blocks --> preempt the NEWEST running request until it fits (this one, if newest):
            preemption_mode "swap" and CPU blocks free --> swapped (KV to host memory)
            else                                      --> front of waiting, KV freed (recompute)
    swapped (oldest first) --swap back in when blocks allow--> running   (not in a step that
        preempted; while any stay swapped no waiting request is admitted, so they cannot starve)

With `speculative` set, a greedy decoding request may carry n-gram drafts after its last token
(spec_decode.py), only when their blocks do not take what the requests after it may need: a draft
never causes a preemption. With LoRA, running requests of an adapter that has no slot in this step
sit it out (the oldest go first, so the set changes as they finish). With steps in flight (async
scheduling, pipeline stages), core/in_flight.py says which running requests may be scheduled.
Pure Python, no JAX.
"""

from __future__ import annotations

from jaxserve.core import in_flight
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.scheduler_state import SchedulerState
from jaxserve.core.spec_decode import draft_budget, draft_share, propose_drafts


class Preemption(SchedulerState):
    """The running and swapped passes of schedule(), and preempting a running request."""

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
        extra = (self.kv.blocks_needed(end + num_drafts) - self.kv.blocks_needed(end)) * self.kv.num_groups
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
