"""Per-step sampler inputs: one pytree built on the host, sent in one `device_put`.

The sampler is compiled once per request-count bucket S and per static variant
(`all_greedy`, `use_penalties`, `use_top_filters`) during warm-up, so every
array here has a shape fixed by S and by module constants, never by the data:

    rows 0 .. len(rows)-1   the scheduled requests, in the runner's order
    rows len(rows) .. S-1   padding: greedy, no penalties, nothing suppressed

`token_history` is the one large input ([S, max_model_len]); it is only filled
when some row uses penalties, otherwise it is an [S, 1] dummy (a different
static variant, so a different compiled program, not a different shape at run
time of the same program).

`token_bitmask` carries structured outputs, allowed_token_ids and bad_words (filled on the host by
core/structured_output.py): bit t of word t // 32 is token t's. Its width W = ceil(V / 32) is
fixed by the model, so it is always present (all -1 when no row is constrained) and the sampler
applies it under a lax.cond: no extra compiled program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import numpy as np

from jaxserve.core.sampling_params import SamplingParams

# Per-row caps on the sparse inputs. They are static shapes; the builder
# raises ValueError beyond them (the engine should check at admission too).
MAX_SUPPRESS_IDS = 16  # eos ids + stop_token_ids suppressed while below min_tokens
MAX_LOGIT_BIAS = 64  # entries of SamplingParams.logit_bias

_PAD_ID = -1


def _static() -> dict[str, bool]:
    return {"static": True}


class RowInfo(NamedTuple):
    """What the builder needs to know about one scheduled request.

    `suppress_ids=None` derives min_tokens suppression from `params`: while
    fewer than `min_tokens` tokens were generated, the stop_token_ids and
    (unless ignore_eos) the eos ids are forced to -inf. Pass a sequence to
    override (an empty one suppresses nothing).
    """

    params: SamplingParams
    seed: int  # the request's seed; the engine draws one at admission if the user gave none
    step: int  # number of tokens this sample has generated so far
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    suppress_ids: Sequence[int] | None = None


def min_tokens_suppress_ids(params: SamplingParams, num_output_tokens: int) -> list[int]:
    """Token ids to force to -inf this step because min_tokens is not reached yet."""
    if num_output_tokens >= params.min_tokens:
        return []
    ids = list(params.stop_token_ids or [])
    if not params.ignore_eos:
        ids += [t for t in params.eos_token_ids if t not in ids]
    return ids


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [S] f32, < 1e-5 => greedy row
    top_p: jax.Array  # [S] f32, 1.0 => off
    top_k: jax.Array  # [S] i32, 0 => off
    min_p: jax.Array  # [S] f32, 0.0 => off
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32, 1.0 => off
    seeds: jax.Array  # [S] u32, the request seed modulo 2**32
    steps: jax.Array  # [S] i32, tokens generated so far; key = fold_in(key(seed), step)
    token_history: jax.Array  # [S, H] i32, prompt + output ids, -1 padded; H = max_model_len or 1
    num_prompt_tokens: jax.Array  # [S] i32, splits token_history into prompt | output
    suppress_ids: jax.Array  # [S, MAX_SUPPRESS_IDS] i32, -1 padded
    bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] i32, -1 padded
    bias_values: jax.Array  # [S, MAX_LOGIT_BIAS] f32, 0 padded
    # [S] i32, top logprobs the row returns (SamplingParams.logprobs, 0 when None). The sampler
    # runs its top-N only when some row asks (a lax.cond: no extra program).
    num_logprobs: jax.Array
    # [S, W] i32, bit t % 32 of word t // 32: token t may be sampled; -1 everywhere => unconstrained
    token_bitmask: jax.Array
    all_greedy: bool = field(default=False, metadata=_static())
    use_penalties: bool = field(default=False, metadata=_static())
    use_top_filters: bool = field(default=False, metadata=_static())

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def build(cls, rows: Sequence[RowInfo | tuple], num_rows_padded: int,
              max_model_len: int, token_bitmask: np.ndarray | None = None,
              num_mask_words: int = 1) -> SamplingMetadata:
        """Pad `rows` to `num_rows_padded` and send the whole tree to the device at once."""
        return jax.device_put(cls.build_host(rows, num_rows_padded, max_model_len, token_bitmask, num_mask_words))

    @classmethod
    def build_host(cls, rows: Sequence[RowInfo | tuple], num_rows_padded: int,
                   max_model_len: int, token_bitmask: np.ndarray | None = None,
                   num_mask_words: int = 1) -> SamplingMetadata:
        """Same as `build`, leaves are numpy arrays (for tests and inspection)."""
        infos = [r if isinstance(r, RowInfo) else RowInfo(*r) for r in rows]
        num_rows = len(infos)
        if num_rows > num_rows_padded:
            raise ValueError(f"num_rows_padded ({num_rows_padded}) < number of rows ({num_rows})")
        sampled = [r for r in infos if not r.params.greedy]
        all_greedy = not sampled
        use_penalties = any(r.params.needs_penalties for r in infos)
        use_top_filters = any(r.params.needs_sort for r in sampled)
        md = cls.dummy(num_rows_padded, max_model_len, all_greedy=all_greedy,
                       use_penalties=use_penalties, use_top_filters=use_top_filters, num_mask_words=num_mask_words)
        for i, r in enumerate(infos):
            _fill_row(md, i, r, max_model_len)
        if token_bitmask is not None:  # [len(rows), W]: the rows' masks, in the same order
            if token_bitmask.shape != (num_rows, num_mask_words):
                raise ValueError(f"token_bitmask: shape {token_bitmask.shape}, expected {(num_rows, num_mask_words)}")
            md.token_bitmask[:num_rows] = token_bitmask
        return md

    @classmethod
    def dummy(cls, num_rows: int, max_model_len: int, *, all_greedy: bool = True,
              use_penalties: bool = False, use_top_filters: bool = False,
              num_mask_words: int = 1) -> SamplingMetadata:
        """All-padding metadata (numpy leaves): the builder's start and a warm-up input."""
        s = num_rows
        f32 = lambda v: np.full((s,), v, np.float32)  # noqa: E731
        return cls(
            temperature=f32(0.0), top_p=f32(1.0), top_k=np.zeros((s,), np.int32), min_p=f32(0.0),
            presence_penalty=f32(0.0), frequency_penalty=f32(0.0), repetition_penalty=f32(1.0),
            seeds=np.zeros((s,), np.uint32), steps=np.zeros((s,), np.int32),
            token_history=np.full((s, max_model_len if use_penalties else 1), _PAD_ID, np.int32),
            num_prompt_tokens=np.zeros((s,), np.int32),
            suppress_ids=np.full((s, MAX_SUPPRESS_IDS), _PAD_ID, np.int32),
            bias_ids=np.full((s, MAX_LOGIT_BIAS), _PAD_ID, np.int32),
            bias_values=np.zeros((s, MAX_LOGIT_BIAS), np.float32),
            num_logprobs=np.zeros((s,), np.int32),
            token_bitmask=np.full((s, num_mask_words), -1, np.int32),
            all_greedy=all_greedy, use_penalties=use_penalties,
            use_top_filters=use_top_filters and not all_greedy)

    @classmethod
    def warmup_variants(cls, num_rows: int, max_model_len: int,
                        num_mask_words: int = 1) -> list[SamplingMetadata]:
        """One device input per distinct compiled program for this bucket (6 in all)."""
        variants = []
        for all_greedy in (True, False):
            for use_penalties in (False, True):
                for use_top_filters in ((False,) if all_greedy else (False, True)):
                    variants.append(jax.device_put(cls.dummy(
                        num_rows, max_model_len, all_greedy=all_greedy,
                        use_penalties=use_penalties, use_top_filters=use_top_filters,
                        num_mask_words=num_mask_words)))
        return variants


def _fill_row(md: SamplingMetadata, i: int, r: RowInfo, max_model_len: int) -> None:
    """Write one request into row i of the (numpy, freshly allocated) metadata."""
    p = r.params
    if not p.greedy:
        md.temperature[i] = p.temperature
        md.top_p[i] = p.top_p
        md.top_k[i] = p.top_k
        md.min_p[i] = p.min_p
    md.seeds[i] = r.seed & 0xFFFFFFFF
    md.steps[i] = r.step
    md.num_logprobs[i] = p.logprobs or 0
    if p.needs_penalties:
        md.presence_penalty[i] = p.presence_penalty
        md.frequency_penalty[i] = p.frequency_penalty
        md.repetition_penalty[i] = p.repetition_penalty
        num_prompt, num_output = len(r.prompt_token_ids), len(r.output_token_ids)
        if num_prompt + num_output > max_model_len:
            raise ValueError(f"token_history: prompt + output ({num_prompt + num_output}) "
                             f"exceeds max_model_len ({max_model_len})")
        md.token_history[i, :num_prompt] = r.prompt_token_ids
        md.token_history[i, num_prompt:num_prompt + num_output] = r.output_token_ids
        md.num_prompt_tokens[i] = num_prompt
    suppress = (min_tokens_suppress_ids(p, len(r.output_token_ids))
                if r.suppress_ids is None else list(r.suppress_ids))
    if len(suppress) > MAX_SUPPRESS_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_SUPPRESS_IDS} ids (with eos) can be "
                         f"suppressed under min_tokens, got {len(suppress)}")
    md.suppress_ids[i, :len(suppress)] = suppress
    bias = p.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    if any(t < 0 for t in bias):
        raise ValueError("logit_bias: token ids must be non-negative")
    md.bias_ids[i, :len(bias)] = list(bias.keys())
    md.bias_values[i, :len(bias)] = list(bias.values())
