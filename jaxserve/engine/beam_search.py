"""Beam search on top of the engine, the way vLLM V1 does it: each round asks the engine
for one token (with the top 2*width logprobs) from every live beam, then keeps the best
`width` extensions. With prefix caching on, the beams' common prefix blocks are shared in
the pool (reference counted) rather than recomputed; without it each round re-prefills.

Rounds run until every beam has finished (eos) or reached max_tokens; then all beams are
ranked by cumulative logprob / (length ** length_penalty): the generated length for the
SamplingParams form (`use_beam_search=True`), vLLM LLM.beam_search's length for its
`BeamSearchParams` form (prompt plus generated tokens, less a final eos; get_beam_search_score).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Callable, Generator

from pydantic import Field

from jaxserve.core.validation import config_dataclass
from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.core.sampling_params import MAX_LOGPROBS, SamplingParams


@config_dataclass()
class BeamSearchParams:
    """vLLM's `BeamSearchParams` for `LLM.beam_search`. `temperature` is accepted and has no effect
    here (as in vLLM, candidates are ranked by the raw logprobs); `include_stop_str_in_output` too:
    the offline form keeps a final eos in `tokens`, as vLLM's LLM.beam_search does."""

    beam_width: Annotated[int, Field(ge=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    ignore_eos: bool = False
    temperature: Annotated[float, Field(ge=0.0)] = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False


@dataclass
class BeamSearchSequence:
    """One beam of vLLM's BeamSearchOutput: `tokens` and `text` hold the prompt and the generated part."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: object | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: the best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # each step's candidates

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / (max(len(self.tokens), 1) ** length_penalty)


def step_params(params: SamplingParams, width: int) -> SamplingParams:
    """One greedy-scored token per beam with enough candidates to refill every beam."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=min(2 * width, MAX_LOGPROBS),
                          ignore_eos=True, skip_special_tokens=params.skip_special_tokens)


def expand(beams: list[Beam], candidates: list[list[tuple[int, float]]], params: SamplingParams,
           width: int, eos_ids: tuple[int, ...]) -> tuple[list[Beam], list[Beam]]:
    """Extend each live beam by its candidates; return (the best `width` live beams, beams finished now)."""
    pool = []
    for b, cands in zip(beams, candidates):
        step = {tok: Logprob(lp, rank) for rank, (tok, lp) in enumerate(cands, start=1)}
        pool += [Beam(b.tokens + [tok], b.cum_logprob + lp, logprobs=b.logprobs + [step]) for tok, lp in cands]
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


def search(prompt_ids: list[int], params: SamplingParams, max_model_len: int, eos_ids: tuple[int, ...],
           vllm_score: bool = False) -> Search:
    """The search as a coroutine, whatever drives the engine: it yields each round's
    one-token prompts (prompt + beam), is sent back each prompt's candidates
    [(token, logprob)] best first, and returns the n best beams (`vllm_score`: ranked by
    BeamSearchParams' rule, the prompt counted in the length)."""
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
    if vllm_score:
        def key(b: Beam) -> float:  # vLLM's get_beam_search_score
            length = len(prompt_ids) + len(b.tokens) - (1 if b.finish_reason == "stop" else 0)
            return b.cum_logprob / (length ** params.length_penalty)
    else:
        def key(b: Beam) -> float:
            return b.score(params.length_penalty)
    return sorted(done, key=key, reverse=True)[: params.n]


def as_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """The SamplingParams form of vLLM's BeamSearchParams (every beam returned: n = beam_width)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
    return SamplingParams(use_beam_search=True, beam_width=params.beam_width, n=params.beam_width,
                          max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                          length_penalty=params.length_penalty,
                          include_stop_str_in_output=params.include_stop_str_in_output)


def to_vllm_output(prompt_ids: list[int], beams: list[Beam], decode: Callable[[list[int]], str]) -> BeamSearchOutput:
    """vLLM's BeamSearchOutput: each sequence's tokens and text hold the prompt too (decoded whole,
    special tokens kept, as vLLM's `tokenizer.decode(beam.tokens)`)."""
    return BeamSearchOutput([BeamSearchSequence(tokens=prompt_ids + b.tokens, logprobs=b.logprobs,
                                                cum_logprob=b.cum_logprob, text=decode(prompt_ids + b.tokens),
                                                finish_reason=b.finish_reason) for b in beams])


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


def check(params: SamplingParams, max_logprobs: int = MAX_LOGPROBS) -> None:
    """Each round asks 2 x beam_width logprobs of a beam (vLLM's rule), within --max-logprobs."""
    if 2 * width_of(params) > max_logprobs:
        raise ValueError(f"beam_width: at most {max_logprobs // 2} (2 x beam_width logprobs a round, max_logprobs "
                         f"{max_logprobs}), got {width_of(params)}")
    if params.n > width_of(params):
        raise ValueError(f"n: must be <= beam_width ({width_of(params)}) with beam search")
    if params.structured_outputs is not None:  # the one-token rounds could not keep to it
        raise ValueError("structured_outputs: not supported with beam search")
