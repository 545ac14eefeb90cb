"""`update()`: a step's results applied to its requests.

    SchedulerOutput + ModelOutput --> per sampled request: accepted tokens (sampled + agreed drafts),
        stop checks --> RequestUpdate list; prefix-cache blocks registered; pending samples forked;
        finished requests unqueued and their blocks freed

A speculative request keeps the drafts the model agreed with and leaves `num_computed_tokens`
short of the rest (spec_decode.accept_tokens: their KV slots are written again later). A
prefill-only request finishes in its one step with the runner's pooled row. With async scheduling
the next step is already scheduled; results of requests finished or aborted since are dropped.
Pure Python, no JAX.
"""

from __future__ import annotations

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import ModelOutput, RequestUpdate, SampledToken, ScheduledRequest, SchedulerOutput
from jaxserve.core.scheduler_state import SchedulerState
from jaxserve.core.spec_decode import accept_tokens


class StepUpdate(SchedulerState):
    """update(): a step's sampled tokens and pooled rows applied to its requests."""

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
