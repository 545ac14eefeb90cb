"""On-device sampler: a pure function of (logits, SamplingMetadata).

The runner jits `sample` separately from the model step; it compiles once per
request-count bucket S and per static variant of the metadata (see
`SamplingMetadata.warmup_variants`). Processing order follows vLLM:

    raw logits ──► logprobs / ranks / top-20        (vLLM's "raw_logprobs", the default)
        │
        ├─ + logit_bias, min_tokens suppression (-inf)
        ├─ token bitmask (structured outputs, allowed_token_ids, bad_words): 0 bit -> -inf,
        │  under a lax.cond, so an unconstrained batch skips the [S, V] unpacking
        ├─ penalties: repetition (prompt + output), frequency, presence (output only)
        ├─ greedy rows: argmax
        └─ other rows: / temperature, top_k, top_p, min_p, Gumbel-max with
           key = fold_in(key(seed), step)  → a row's token does not depend on
           the batch it is in or its position there.

`logprobs_mode` (the engine's --logprobs-mode, a static choice: one program per engine) picks what
the logprobs are taken from, as vLLM: raw_* from the raw logits, processed_* from what the token
was drawn from (bias, masks and penalties applied; sampled rows also / temperature with top_k,
top_p and min_p filtered to -inf; greedy rows are not scaled or filtered, as vLLM's greedy
batches); *_logprobs log-softmax them, *_logits return the values themselves.

Variants are what keep it cheap: `all_greedy` skips the random draw and the
filters; `use_top_filters=False` skips the top-256 partial sort (and the rare
full-sort fallback); `use_penalties=False` skips the [S, H] -> [S, V] count scatter.
Three XLA:CPU traps shaped the code (each measured at V=49152): jnp.argmax,
threefry over all S x V entries, and a full jnp.sort are each 10-50x slower
than what replaces them here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.sample.sampling_metadata import SamplingMetadata
from jaxserve.core.sampling_params import MAX_LOGPROBS

_GREEDY_EPS = 1e-5  # same threshold as SamplingParams.greedy
# Width of the partial sort that top_k / top_p use before falling back to a full sort.
TOP_FILTER_CANDIDATES = 256
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")  # vLLM's


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # [S] i32, the sampled tokens
    logprobs: jax.Array  # [S] f32, log-softmax of the raw logits at token_ids (see logprobs_mode)
    ranks: jax.Array  # [S] i32, 1-based rank of token_ids in the raw logits (see logprobs_mode)
    top_ids: jax.Array  # [S, MAX_LOGPROBS] i32, best first
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] f32, raw log-softmax at top_ids (see logprobs_mode)


def sample(logits: jax.Array, md: SamplingMetadata, logprobs_mode: str = "raw_logprobs") -> SamplerOutput:
    """Sample one token per row of `logits` ([S, V], V >= MAX_LOGPROBS); `logprobs_mode`: what its
    logprobs, ranks and top-N are taken from (LOGPROBS_MODES, the module's docstring)."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
    logits = logits.astype(jnp.float32)
    processed = apply_bias_and_suppression(logits, md.bias_ids, md.bias_values, md.suppress_ids)
    processed = jax.lax.cond(jnp.any(md.token_bitmask != -1), apply_token_bitmask, lambda x, _: x,
                             processed, md.token_bitmask)
    if md.use_penalties:
        processed = apply_penalties(processed, md)
    token_ids = argmax(processed)
    drawn_from = processed
    if not md.all_greedy:
        greedy = md.temperature < _GREEDY_EPS
        scaled = scale_and_filter(processed, md)
        sampled = argmax(scaled + gumbel_noise(md.seeds, md.steps, logits.shape[-1]))
        token_ids = jnp.where(greedy, token_ids, sampled)
        if logprobs_mode.startswith("processed"):  # a greedy row's own values, whatever its batch
            drawn_from = jnp.where(greedy[:, None], processed, scaled)
    values = logits if logprobs_mode.startswith("raw") else drawn_from
    return compute_logprobs(values, token_ids, want_top=jnp.any(md.num_logprobs > 0),
                            normalize=logprobs_mode.endswith("logprobs"))


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (first index of the max), as max + min-index.

    XLA:CPU's variadic (value, index) reduce is not vectorised: 10-40x slower at V=49k.
    """
    vocab_size = x.shape[-1]
    is_max = x == jnp.max(x, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(is_max, jnp.arange(vocab_size, dtype=jnp.int32), vocab_size), axis=-1)
    return jnp.minimum(first, vocab_size - 1)  # a NaN row matches nothing


def _out_of_range_for_padding(ids: jax.Array, vocab_size: int) -> jax.Array:
    """Map -1 padding to `vocab_size` so `mode="drop"` scatters skip it (negative ids wrap)."""
    return jnp.where(ids < 0, vocab_size, ids)


def apply_bias_and_suppression(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array,
                               suppress_ids: jax.Array) -> jax.Array:
    num_rows, vocab_size = logits.shape
    rows = jnp.arange(num_rows)[:, None]  # [S, 1]
    logits = logits.at[rows, _out_of_range_for_padding(bias_ids, vocab_size)].add(
        bias_values, mode="drop")
    return logits.at[rows, _out_of_range_for_padding(suppress_ids, vocab_size)].set(
        -jnp.inf, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's bit is 0. logits [S, V] f32; bitmask [S, W] i32 (bit t % 32 of word
    t // 32 is token t). Tokens past 32 * W are left alone (serving sets W = ceil(V / 32))."""
    vocab_size, num_words = logits.shape[-1], bitmask.shape[-1]
    index = jnp.arange(vocab_size, dtype=jnp.int32)  # [V]
    words = bitmask[:, jnp.minimum(index // 32, num_words - 1)]  # [S, V]
    allowed = ((words >> (index % 32)) & 1).astype(jnp.bool_) | (index >= 32 * num_words)
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """vLLM's penalties: repetition over prompt + output, frequency / presence over output."""
    num_rows, vocab_size = logits.shape
    history = md.token_history  # [S, H]
    valid = history >= 0
    positions = jnp.arange(history.shape[1])[None, :]  # [1, H]
    is_output = valid & (positions >= md.num_prompt_tokens[:, None])  # [S, H]
    ids = _out_of_range_for_padding(history, vocab_size)
    rows = jnp.arange(num_rows)[:, None]
    output_counts = jnp.zeros((num_rows, vocab_size), jnp.float32).at[rows, ids].add(
        is_output.astype(jnp.float32), mode="drop")  # [S, V]
    seen = jnp.zeros((num_rows, vocab_size), jnp.bool_).at[rows, ids].set(True, mode="drop")
    penalty = md.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / penalty, logits * penalty)
    logits = jnp.where(seen, repeated, logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    return logits - md.presence_penalty[:, None] * (output_counts > 0).astype(jnp.float32)


def apply_top_filters(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                      min_p: jax.Array) -> jax.Array:
    """Set to -inf what top_k, then top_p (on the renormalised top_k set), then min_p drop.

    Filtering is by a threshold value, so tokens tied with the last kept one
    are kept too. A full sort of [S, V] costs ~1 s at S=64, V=49k on CPU, so
    the thresholds come from the best TOP_FILTER_CANDIDATES logits when that
    is exact for every row, and from a full sort (lax.cond) otherwise.
    """
    vocab_size = logits.shape[-1]
    num_candidates = min(TOP_FILTER_CANDIDATES, vocab_size)
    candidates, _ = jax.lax.top_k(logits, num_candidates)  # [S, C], best first
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)  # [S]
    # Normaliser of the top_k set: over the candidates when it is inside them, else the full row.
    row_lse = jax.nn.logsumexp(logits, axis=-1)
    threshold, exact = _top_k_top_p_threshold(candidates, k, top_p, row_lse, vocab_size)
    threshold = jax.lax.cond(
        jnp.all(exact), lambda: threshold,
        lambda: _top_k_top_p_threshold(-jnp.sort(-logits, axis=-1), k, top_p, row_lse,
                                       vocab_size)[0])
    # min_p: p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
    min_p_threshold = jnp.max(logits, axis=-1) + jnp.log(min_p)
    keep = (logits >= threshold[:, None]) & (logits >= min_p_threshold[:, None])
    return jnp.where(keep, logits, -jnp.inf)


def _top_k_top_p_threshold(sorted_desc: jax.Array, k: jax.Array, top_p: jax.Array,
                           row_lse: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Smallest kept logit per row from the best C logits of a row (C <= V), and whether exact.

    sorted_desc: [S, C] f32; k: [S] i32 in [1, V]; top_p: [S] f32; row_lse: [S] f32.
    Returns (threshold [S] f32, -inf where nothing is cut; exact [S] bool). Exact
    when the top_k set lies inside the candidates, or top_k is off and the
    top_p cut (if any) falls inside them.
    """
    num_candidates = sorted_desc.shape[-1]
    positions = jnp.arange(num_candidates)[None, :]
    in_top_k = positions < k[:, None]  # [S, C]
    k_inside = k <= num_candidates
    candidate_lse = jax.nn.logsumexp(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    lse = jnp.where(k_inside, candidate_lse, row_lse)  # row_lse is right only when k == V
    probs = jnp.where(in_top_k, jnp.exp(sorted_desc - lse[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    exclusive_cum = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
    # top_p == 1 keeps all of top_k even where the float32 cumsum reaches 1 early.
    no_top_p = top_p >= 1.0
    keep = in_top_k & ((exclusive_cum < top_p[:, None]) | no_top_p[:, None])
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # keep is a prefix: cum is monotone
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)[:, 0]
    top_k_off = k >= vocab_size
    exact = k_inside | (top_k_off & (no_top_p | (num_keep < num_candidates)))
    return jnp.where(top_k_off & no_top_p, -jnp.inf, threshold), exact


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def gumbel_noise(seeds: jax.Array, steps: jax.Array, vocab_size: int) -> jax.Array:
    """[S, V] f32 Gumbel(0, 1) noise; row i depends only on (seeds[i], steps[i]).

    The row key is threefry's fold_in(key(seed), step); it is spread over the
    vocabulary by a keyed counter hash (two murmur3 finaliser rounds) because
    threefry for every one of S x V entries costs ~2-4 ms a row on CPU, 8x this.
    Uniforms have 24 bits, so the noise lies in [-2.9, 17.3]: tails of mass ~3e-8 are cut.
    """
    def row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
        return jax.random.key_data(jax.random.fold_in(jax.random.key(seed), step))

    keys = jax.vmap(row_key)(seeds, steps).astype(jnp.uint32)  # [S, 2]
    index = jnp.arange(vocab_size, dtype=jnp.uint32)[None, :]  # [1, V]
    bits = _fmix32(_fmix32(index * jnp.uint32(0x9E3779B9) + keys[:, :1]) ^ keys[:, 1:])  # [S, V]
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    return -jnp.log(-jnp.log(uniform))


def scale_and_filter(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """What a sampled row draws from (by Gumbel-max): logits / temperature, top_k / top_p / min_p
    cut to -inf; greedy rows get garbage (masked by the caller)."""
    temperature = jnp.where(md.temperature < _GREEDY_EPS, 1.0, md.temperature)
    scaled = logits / temperature[:, None]
    if md.use_top_filters:
        scaled = apply_top_filters(scaled, md.top_k, md.top_p, md.min_p)
    return scaled


# Greedy rows from the hidden states in vocabulary slices (`sample_greedy_in_slices`): XLA:CPU
# takes 14-20 ms more for argmax and log-softmax over [64, 49152] materialised logits than over
# the same values a [64, 4096] slice at a time, which stays in cache (sampler rows >= 48 only: at 8-32
# rows the one big product is as fast). With the CPU's bfloat16 dots (_sample_step's head_dots) every
# plain greedy step takes the slices: a bfloat16 dot over the whole head converts all of it first
# (31-58 ms at 8-64 rows against float32's 11-51), a slice's stays in cache (16.5 ms at 64 rows
# against float32 slices' 26.8, 7.0 at 8 against 9.9, Zen 4).
VOCAB_SLICE = 4096
SLICED_MIN_ROWS = 48


def vocab_slices(vocab_size: int, target: int = VOCAB_SLICE) -> int:
    """How many equal slices of about `target` tokens the vocabulary splits into; 0 when no
    slice size from target / 2 to 2 * target divides it."""
    counts = [n for n in range(max(1, vocab_size // (2 * target)), vocab_size // (target // 2) + 1)
              if vocab_size % n == 0 and target // 2 <= vocab_size // n <= 2 * target]
    return min(counts, key=lambda n: abs(vocab_size / n - target), default=0)


def plain_greedy(md: SamplingMetadata) -> jax.Array:
    """A bool scalar: every row is greedy over the raw logits and wants no top-N (no bias,
    suppression, token mask, penalties or logprobs beyond the sampled token's)."""
    if not md.all_greedy or md.use_penalties:
        return jnp.array(False)
    return ~(jnp.any(md.bias_ids >= 0) | jnp.any(md.suppress_ids >= 0) | jnp.any(md.token_bitmask != -1)
             | jnp.any(md.num_logprobs > 0))


def sample_greedy_in_slices(num_rows: int, vocab_size: int, num_slices: int,
                            slice_logits: Callable[[jax.Array, int], jax.Array],
                            normalize: bool = True) -> SamplerOutput:
    """What `sample` gives for plain greedy rows (see plain_greedy), one vocabulary slice of the
    head at a time: `slice_logits(start, size)` is the float32 logits [num_rows, size] of tokens
    [start, start + size). A running max, its first index and the rescaled sum of exponentials
    (the log-softmax normaliser): the sampled token is the max, so its rank is 1 and its
    logprob is -log(sum exp(logits - max)); normalize=False (the *_logits modes: a plain greedy
    row's processed values are its raw ones): its logit, the max itself."""
    size = vocab_size // num_slices

    def one_slice(carry, start):
        best, token, total = carry
        logits = slice_logits(start, size)  # [S, size]
        m = jnp.max(logits, axis=-1)
        first = argmax(logits) + start
        new_best = jnp.maximum(best, m)
        total = total * jnp.exp(best - new_best) + jnp.sum(jnp.exp(logits - new_best[:, None]), axis=-1)
        return (new_best, jnp.where(m > best, first, token), total), None

    init = (jnp.full((num_rows,), -jnp.inf, jnp.float32), jnp.zeros((num_rows,), jnp.int32),
            jnp.zeros((num_rows,), jnp.float32))
    starts = jnp.arange(num_slices, dtype=jnp.int32) * size
    (best, token, total), _ = jax.lax.scan(one_slice, init, starts)
    top_logprobs, top_ids = _no_top(num_rows)
    return SamplerOutput(token_ids=token, logprobs=-jnp.log(total) if normalize else best,
                         ranks=jnp.ones((num_rows,), jnp.int32),
                         top_ids=top_ids, top_logprobs=top_logprobs)


def _no_top(num_rows: int) -> tuple[jax.Array, jax.Array]:
    """The top-N of a batch that asks for none: token 0 at -inf in every slot (costs nothing)."""
    shape = (num_rows, MAX_LOGPROBS)
    return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.int32)


def compute_logprobs(logits: jax.Array, token_ids: jax.Array, want_top: jax.Array | None = None,
                     normalize: bool = True) -> SamplerOutput:
    """Logprob, rank and top-N of the sampled tokens, all from `logits` (normalize=False: the
    values themselves, the *_logits modes).

    Works on logits and subtracts the normaliser, so no [S, V] log-softmax is materialised.
    The max comes from jnp.max, not top_logits[:, :1]: feeding top_k's output back into
    an [S, V] reduction makes XLA:CPU replace top_k by a full sort (50x slower).
    `want_top` (a bool scalar): when false, the top-N is token 0 at -inf and costs nothing; on
    XLA:CPU the top-20 over V=49152 is 3.6 ms of a 32-row sampler's 4.7 ms.
    """
    def top(x):
        return tuple(jax.lax.top_k(x, MAX_LOGPROBS))  # [S, N], best first

    top_logits, top_ids = top(logits) if want_top is None else jax.lax.cond(
        want_top, top, lambda x: _no_top(x.shape[0]), logits)
    if normalize:
        row_max = jnp.max(logits, axis=-1, keepdims=True)  # [S, 1]
        lse = row_max + jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))
    else:
        lse = jnp.zeros((logits.shape[0], 1), jnp.float32)
    token_logits = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)  # [S, 1]
    ranks = 1 + jnp.sum((logits > token_logits).astype(jnp.int32), axis=-1)
    return SamplerOutput(token_ids=token_ids, logprobs=(token_logits - lse)[:, 0],
                         ranks=ranks.astype(jnp.int32), top_ids=top_ids.astype(jnp.int32),
                         top_logprobs=top_logits - lse)
