"""Turn scheduler updates into user-facing RequestOutputs: detokenize, match stop strings,
collect logprobs and timings, and gather the n / best_of samples of one request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler_output import SampledToken


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


def new_group(request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
              child_ids: list[str], tokenizer: PreTrainedTokenizerBase | None, arrival_time: float) -> RequestGroup:
    samples = []
    for i, cid in enumerate(child_ids):
        detok = None
        if tokenizer is not None:
            detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                                           stop=list(params.stop), include_stop_str_in_output=params.include_stop_str_in_output)
        samples.append(SampleState(cid, i, detok, logprobs=[] if params.logprobs is not None else None))
    group = RequestGroup(request_id, prompt, prompt_token_ids, params, samples, RequestMetrics(arrival_time))
    if params.prompt_logprobs is not None:
        group.prompt_logprobs = [None] * len(prompt_token_ids)
    return group


def absorb_prompt_logprobs(group: RequestGroup, entries: dict[int, SampledToken],
                           tokenizer: PreTrainedTokenizerBase | None) -> None:
    if group.prompt_logprobs is None:
        return
    for pos, s in entries.items():
        if group.prompt_logprobs[pos] is None:  # a recompute after preemption gives the same values
            group.prompt_logprobs[pos] = _logprob_entry(s, s.token_id, tokenizer)


def absorb(group: RequestGroup, sample: SampleState, req: Request, sampled: list[SampledToken],
           tokenizer: PreTrainedTokenizerBase | None, now: float) -> str | None:
    """Take the request's new tokens into `sample`; returns a matched stop string, if any.

    `sampled`: the runner's entries for the new tokens, in order (several when speculative
    drafts were accepted this step)."""
    new = req.output_token_ids[len(sample.token_ids):]
    stop_hit = None
    if new:
        if sample.detok is not None:
            fed = sample.detok.num_fed
            delta, stop_hit = sample.detok.add_tokens(new)
            sample.text += delta
            if stop_hit is not None:  # accepted drafts after the stop string are not output
                new = new[: sample.detok.num_fed - fed]
        sample.token_ids.extend(new)
        m = group.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        if sample.index == 0:
            m.token_times.extend([now] * len(new))
        for token_id, s in zip(new, sampled):
            if s.logprob is None:
                continue
            sample.cumulative_logprob += s.logprob
            if sample.logprobs is not None:
                sample.logprobs.append(_logprob_entry(s, token_id, tokenizer))
    if stop_hit is not None:
        sample.finish_reason, sample.stop_reason = "stop", stop_hit
    elif req.is_finished:
        finish(sample, req.finish_reason, req.stop_reason)
    return stop_hit


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
