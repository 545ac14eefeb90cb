"""Beam search on top of the engine, the way vLLM V1 does it: each round asks the engine
for one token (with the top 2*width logprobs) from every live beam, then keeps the best
`width` extensions. With prefix caching on, the beams' common prefix blocks are shared in
the pool (reference counted) rather than recomputed; without it each round re-prefills.

Rounds run until every beam has finished (eos) or reached max_tokens; then all beams are
ranked by vLLM's score, cumulative logprob / (generated length ** length_penalty).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.core.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / (max(len(self.tokens), 1) ** length_penalty)


def step_params(params: SamplingParams, width: int) -> SamplingParams:
    """One greedy-scored token per beam with enough candidates to refill every beam."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=min(2 * width, MAX_LOGPROBS),
                          ignore_eos=True, skip_special_tokens=params.skip_special_tokens)


def expand(beams: list[Beam], candidates: list[list[tuple[int, float]]], params: SamplingParams,
           width: int, eos_ids: tuple[int, ...]) -> tuple[list[Beam], list[Beam]]:
    """Extend each live beam by its candidates; return (the best `width` live beams, beams finished now)."""
    pool = [Beam(b.tokens + [tok], b.cum_logprob + lp) for b, cands in zip(beams, candidates) for tok, lp in cands]
    pool.sort(key=lambda b: b.cum_logprob, reverse=True)
    live, done = [], []
    for b in pool:
        if len(live) == width:
            break
        if not params.ignore_eos and b.tokens[-1] in eos_ids:
            b.finish_reason = "stop"
            done.append(b)
        elif params.max_tokens is not None and len(b.tokens) >= params.max_tokens:
            b.finish_reason = "length"
            done.append(b)
        else:
            live.append(b)
    return live, done


Search = Generator[list[list[int]], list[list[tuple[int, float]]], list[Beam]]


def search(prompt_ids: list[int], params: SamplingParams, max_model_len: int, eos_ids: tuple[int, ...]) -> Search:
    """The search as a coroutine, whatever drives the engine: it yields each round's
    one-token prompts (prompt + beam), is sent back each prompt's candidates
    [(token, logprob)] best first, and returns the n best beams."""
    width = width_of(params)
    live: list[Beam] = [Beam()]
    done: list[Beam] = []
    while live:
        for b in live:
            if len(prompt_ids) + len(b.tokens) >= max_model_len:
                b.finish_reason = "length"
        done += [b for b in live if b.finish_reason]
        pending = [b for b in live if not b.finish_reason]
        if not pending:
            break
        candidates = yield [prompt_ids + b.tokens for b in pending]
        live, finished = expand(pending, candidates, params, width, eos_ids)
        done += finished
    return sorted(done, key=lambda b: b.score(params.length_penalty), reverse=True)[: params.n]


def to_output(request_id: str, prompt: str | None, prompt_ids: list[int], beams: list[Beam],
              decode: Callable[[list[int]], str]) -> RequestOutput:
    outs = [CompletionOutput(index=i, text=decode(b.tokens), token_ids=b.tokens, cumulative_logprob=b.cum_logprob,
                             finish_reason=b.finish_reason) for i, b in enumerate(beams)]
    return RequestOutput(request_id, prompt, prompt_ids, outs, finished=True)


def width_of(params: SamplingParams) -> int:
    return params.beam_width or params.best_of or params.n


def candidates_from(out: RequestOutput) -> list[tuple[int, float]]:
    entry = out.outputs[0].logprobs[-1]
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda x: -x[1])


def check(params: SamplingParams) -> None:
    if 2 * width_of(params) > MAX_LOGPROBS:
        raise ValueError(f"beam_width: at most {MAX_LOGPROBS // 2}, got {width_of(params)}")
    if params.n > width_of(params):
        raise ValueError(f"n: must be <= beam_width ({width_of(params)}) with beam search")
