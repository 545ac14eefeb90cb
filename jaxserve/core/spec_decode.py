"""Speculative decoding with n-gram (prompt lookup) drafts: vLLM's `{"method": "ngram"}`.

A decoding request whose last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) occurred earlier in its prompt or output proposes the
tokens that followed that earlier occurrence as drafts. The scheduler feeds
them after the request's last token in one step; the sampler scores every
position, and the scheduler keeps the drafts up to the first one that differs
from the model's own token, plus the model's token there. So a step yields
1 to 1 + k tokens, and the output is the one plain decoding gives.

Only greedy requests draft (a random sample would need rejection sampling).
Drafts are limited so that a step samples at most `max_num_seqs` rows (the
sampler's largest bucket): with many requests running a step has no room for
them, and speculation applies to the few long requests a batch ends with,
whose steps are bound by reading the weights, not by the tokens they carry.
Pure Python, no JAX.
"""

from __future__ import annotations

from array import array

from jaxserve.core.request import Request
from jaxserve.core.scheduler_output import SampledToken
# the flag's dataclass lives below the scheduler's output (which holds it); still importable from here
from jaxserve.core.spec_config import SPECULATIVE_METHODS, SpeculativeConfig, SpeculativeMethod  # noqa: F401

def _continuation(token_ids: list[int], start: int, k: int) -> list[int]:
    """k tokens as the sequence went on from `start`. A match that reaches the end (a loop whose
    period is shorter than k) goes on with the proposal itself: the loop, repeated."""
    out = token_ids[start:start + k]
    period = len(token_ids) - start
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (n_max down to n_min) of `token_ids`; [] when none occurs earlier."""
    if k <= 0 or len(token_ids) < 2:
        return []
    buf = array("i", token_ids).tobytes()
    length = len(token_ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = buf[4 * (length - n):]
        # Search before the last token, so the match starts earlier than the suffix itself (it
        # may overlap it: in a loop of period p < n the continuation is the loop).
        end = 4 * (length - 1)
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:  # a whole-token match, not bytes straddling two tokens
                return _continuation(token_ids, at // 4 + n, k)
            end = at + len(pattern) - 1
    return []


def draft_budget(spec: SpeculativeConfig | None, max_num_seqs: int, num_running: int, num_others: int) -> int:
    """Draft tokens a step may carry in all. Every scheduled request samples a row and a step
    samples at most max_num_seqs rows, so drafts take only the rows no request can
    (`num_others`: requests waiting, swapped or waiting to fork)."""
    if spec is None:
        return 0
    if spec.disable_by_batch_size is not None and num_running > spec.disable_by_batch_size:
        return 0
    return max(0, max_num_seqs - num_running - num_others)


def draft_share(drafts_left: int, num_left: int) -> int:
    """Most drafts the next of `num_left` requests still to schedule may take from `drafts_left`:
    an equal share, rounded up, so that a short budget goes to the first requests one draft each
    and the share of a request that proposes fewer flows to the ones after it."""
    return -(-drafts_left // max(1, num_left))


def propose_drafts(spec: SpeculativeConfig | None, req: Request, num_new: int, limit: int,
                   max_model_len: int) -> list[int]:
    """N-gram drafts for a greedy request that decodes this step (at most `limit`), else []. Not
    while a step of it is in flight (async scheduling: its last token is not known yet)."""
    if (spec is None or limit <= 0 or num_new != 1 or req.num_tokens - req.num_computed_tokens != 1
            or req.num_output_placeholders or not req.sampling_params.greedy):
        return []
    # Never past the request's end: a step yields up to 1 + k tokens.
    k = min(spec.num_speculative_tokens, limit, req.max_total_tokens(max_model_len) - req.num_tokens - 1)
    if k <= 0:
        return []
    return propose_ngram(req.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)


def accept_tokens(req: Request, sampled: list[SampledToken], drafts: list[int], max_model_len: int,
                  running: bool) -> list[SampledToken]:
    """Append the sampled token, then each draft row's token while the model agreed with the draft
    before it; stop at the first stop condition. Returns the tokens appended (1 + drafts accepted).
    `running`: False for a request preempted since the step was scheduled, whose KV is recomputed
    (or swapped back) from its tokens anyway."""
    accepted = []
    for j, tok in enumerate(sampled):
        req.output_token_ids.append(tok.token_id)
        accepted.append(tok)
        if req.check_stop(max_model_len) or j == len(drafts) or drafts[j] != tok.token_id:
            break
        req.num_computed_tokens += running  # the model's token is draft j: its KV, computed this step, holds
    return accepted
