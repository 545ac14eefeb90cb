"""Turn scheduler updates into user-facing RequestOutputs: detokenize, match stop strings,
collect logprobs and timings, and gather the n / best_of samples of one request.

`OutputProcessor` owns every unfinished user request (a RequestGroup: one SampleState per
scheduler Request); it reads new tokens only from the scheduler's `RequestUpdate`s, never
from a live Request, so the scheduler's Request is the one owner of output token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler_output import ModelOutput, RequestUpdate, SampledToken, SchedulerOutput
from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass
class SampleState:
    """One of a request's n (or best_of) samples: a scheduler Request of its own."""

    child_id: str
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # what has been released: never text that may still turn into a stop string
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [prompt len], None at position 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """Every unfinished user request, by request id and by scheduler (child) request id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, tuple[RequestGroup, SampleState]] = {}  # child id -> its group, sample

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            child_ids: list[str], arrival_time: float) -> None:
        samples = []
        for i, cid in enumerate(child_ids):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               skip_special_tokens=params.skip_special_tokens, stop=list(params.stop),
                                               include_stop_str_in_output=params.include_stop_str_in_output)
            samples.append(SampleState(cid, i, detok, logprobs=[] if params.logprobs is not None else None))
        group = RequestGroup(request_id, prompt, prompt_token_ids, params, samples, RequestMetrics(arrival_time))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        self.groups[request_id] = group
        for sample in samples:
            self._samples[sample.child_id] = (group, sample)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a user request as aborted; None if it is unknown (or already finished)."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for s in group.samples:
            finish(s, "abort")
        return self._output(group)

    def process(self, out: SchedulerOutput, model_out: ModelOutput,
                updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """One step's outputs, one per user request that changed, and the scheduler requests a
        stop string ended (the engine finishes those in the scheduler)."""
        now = time.monotonic()
        for sr in out.scheduled:  # (async scheduling: some may have finished since)
            if sr.request_id in self._samples:
                group = self._samples[sr.request_id][0]
                group.metrics.first_scheduled_time = group.metrics.first_scheduled_time or now
        for rid, entries in model_out.prompt_logprobs.items():
            if rid in self._samples:
                self._absorb_prompt_logprobs(self._samples[rid][0], entries)
        changed: dict[str, tuple[RequestGroup, int]] = {}
        stopped: list[str] = []
        for u in updates:
            group, sample = self._samples[u.request_id]
            if self._absorb(group, sample, u, now) and not u.finished:
                stopped.append(u.request_id)
            cached = max(changed.get(group.request_id, (group, 0))[1], u.num_cached_tokens)
            changed[group.request_id] = (group, cached)
        return [self._output(group, cached) for group, cached in changed.values()], stopped

    def _output(self, group: RequestGroup, num_cached_tokens: int = 0) -> RequestOutput:
        output = make_output(group, num_cached_tokens)
        if group.finished:
            del self.groups[group.request_id]
            for s in group.samples:
                self._samples.pop(s.child_id, None)
        return output

    def _absorb_prompt_logprobs(self, group: RequestGroup, entries: dict[int, SampledToken]) -> None:
        if group.prompt_logprobs is None:
            return
        for pos, s in entries.items():
            if group.prompt_logprobs[pos] is None:  # a recompute after preemption gives the same values
                group.prompt_logprobs[pos] = _logprob_entry(s, s.token_id, self.tokenizer)

    def _absorb(self, group: RequestGroup, sample: SampleState, update: RequestUpdate, now: float) -> bool:
        """Take the update's tokens into `sample`; True if a stop string ended it."""
        new = update.new_tokens
        stop_hit = None
        if new and sample.finish_reason is None:
            if sample.detok is not None:
                fed = sample.detok.num_fed
                delta, stop_hit = sample.detok.add_tokens([t.token_id for t in new])
                sample.text += delta
                if stop_hit is not None:  # accepted drafts after the stop string are not output
                    new = new[: sample.detok.num_fed - fed]
            sample.token_ids.extend(t.token_id for t in new)
            m = group.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            if sample.index == 0:
                m.token_times.extend([now] * len(new))
            for s in new:
                if s.logprob is None:
                    continue
                sample.cumulative_logprob += s.logprob
                if sample.logprobs is not None:
                    sample.logprobs.append(_logprob_entry(s, s.token_id, self.tokenizer))
        if stop_hit is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_hit
        elif update.finished:
            finish(sample, update.finish_reason, update.stop_reason)
        return stop_hit is not None


def finish(sample: SampleState, reason: str | None, stop_reason: int | str | None = None) -> None:
    if sample.finish_reason is not None:
        return
    if sample.detok is not None:
        sample.text += sample.detok.flush()
    sample.finish_reason, sample.stop_reason = reason, stop_reason


def _logprob_entry(s: SampledToken, token_id: int, tokenizer) -> dict[int, Logprob]:
    def text(t: int) -> str | None:
        return tokenizer.decode([t]) if tokenizer is not None else None

    entry = {token_id: Logprob(s.logprob, s.rank, text(token_id))}
    for rank, (tid, lp) in enumerate(s.top_logprobs or [], start=1):
        entry.setdefault(tid, Logprob(lp, rank, text(tid)))
    return entry


def make_output(group: RequestGroup, num_cached_tokens: int = 0) -> RequestOutput:
    finished = group.finished
    samples = group.samples
    if finished and len(samples) > group.params.n:
        # best_of: keep the n samples with the highest cumulative logprob, best first.
        samples = sorted(samples, key=lambda s: s.cumulative_logprob, reverse=True)[: group.params.n]
    outs = []
    for i, s in enumerate(samples):
        outs.append(CompletionOutput(index=i if finished else s.index, text=s.text, token_ids=list(s.token_ids),
                                     cumulative_logprob=s.cumulative_logprob,
                                     logprobs=list(s.logprobs) if s.logprobs is not None else None,
                                     finish_reason=s.finish_reason, stop_reason=s.stop_reason))
    if finished and group.metrics.finished_time is None:
        group.metrics.finished_time = time.monotonic()
    prompt_lps = list(group.prompt_logprobs) if group.prompt_logprobs is not None else None
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished,
                         prompt_logprobs=prompt_lps, metrics=group.metrics, num_cached_tokens=num_cached_tokens)
