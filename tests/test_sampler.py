"""On-device sampler against numpy references, on small vocabularies."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sample.sampler import (TOP_FILTER_CANDIDATES, _top_k_top_p_threshold,
                                     apply_top_filters, gumbel_noise, sample)
from jaxserve.sample.sampling_metadata import (MAX_LOGIT_BIAS, MAX_SUPPRESS_IDS, RowInfo,
                                               SamplingMetadata)
from jaxserve.core.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_MODEL_LEN = 32
VOCAB = 128  # one vocabulary size for most tests: fewer distinct compilations
sample_jit = jax.jit(sample)


def _row(params: SamplingParams, seed: int = 0, step: int = 0, prompt: list[int] | None = None,
         output: list[int] | None = None, suppress: list[int] | None = None) -> RowInfo:
    return RowInfo(params, seed, step, prompt or [1, 2, 3], output or [], suppress)


def _run(logits: np.ndarray, rows: list[RowInfo], num_rows_padded: int | None = None):
    num_rows_padded = num_rows_padded or max(8, len(rows))
    padded = np.zeros((num_rows_padded, logits.shape[1]), np.float32)
    padded[:len(logits)] = logits
    md = SamplingMetadata.build(rows, num_rows_padded, MAX_MODEL_LEN)
    return jax.device_get(sample_jit(jnp.asarray(padded), md))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _logits(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((num_rows, vocab_size)) * scale).astype(np.float32)


def test_greedy_is_argmax_and_padding_is_harmless():
    logits = _logits(5, VOCAB)
    out = _run(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(5)])
    np.testing.assert_array_equal(out.token_ids[:5], logits.argmax(-1))
    np.testing.assert_array_equal(out.token_ids[5:], 0)  # all-zero padded logits: argmax 0


def test_greedy_rows_in_a_sampled_batch_stay_argmax():
    logits = _logits(8, VOCAB)
    rows = [_row(SamplingParams(temperature=0.0 if i % 2 else 1.5, top_p=0.9), seed=i)
            for i in range(8)]
    out = _run(logits, rows)
    np.testing.assert_array_equal(out.token_ids[1::2], logits[1::2].argmax(-1))


def test_logprobs_ranks_and_top_logprobs_match_numpy():
    logits = _logits(8, VOCAB, seed=3)
    # One row asks for top logprobs: the top-N is computed for every row.
    rows = [_row(SamplingParams(temperature=1.0, logit_bias={7: 5.0}, presence_penalty=0.5,
                                logprobs=5 if i == 3 else None), seed=i, output=[7, 8]) for i in range(8)]
    out = _run(logits, rows)
    ref = _log_softmax(logits)  # raw: before bias, penalties and temperature
    idx = np.arange(8)
    np.testing.assert_allclose(out.logprobs, ref[idx, out.token_ids], rtol=1e-5, atol=1e-5)
    expected_ranks = 1 + (logits > logits[idx, out.token_ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.ranks, expected_ranks)
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), atol=1e-5)


def test_top_logprobs_skipped_when_no_row_asks():
    logits = _logits(8, VOCAB, seed=4)
    out = _run(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(8)])
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    np.testing.assert_allclose(out.logprobs, _log_softmax(logits).max(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.ranks, 1)
    assert not out.top_ids.any() and np.all(out.top_logprobs == -np.inf)  # not computed


def _top_filter_reference(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Boolean keep mask of one row, by the definition (sort, renormalise, cumulate)."""
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(logits.shape, bool)
    k = top_k if top_k > 0 else len(logits)
    top = order[:k]
    probs = np.exp(_log_softmax(logits[top][None])[0])
    exclusive = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    kept = top[(exclusive < top_p) | (top_p >= 1.0)]
    keep[kept] = True
    full = np.exp(_log_softmax(logits[None])[0])
    return keep & (full >= min_p * full.max() * (1 - 1e-5))


@pytest.mark.parametrize("vocab_size,scale,big_k,fast_path", [
    (100, 2.0, True, True),  # V < TOP_FILTER_CANDIDATES: the partial sort is a full one
    (1000, 4.0, False, True),  # peaked rows: every cut falls inside the candidates
    (1000, 0.2, False, False),  # flat rows: top_p needs more than the candidates -> full sort
    (1000, 4.0, True, False),  # top_k beyond the candidates -> full sort
])
def test_top_filters_match_reference_fast_path_and_fallback(vocab_size, scale, big_k, fast_path):
    rng = np.random.default_rng(vocab_size)
    num_rows = 16
    logits = _logits(num_rows, vocab_size, seed=1, scale=scale)
    top_k = rng.choice([0, 1, 5, 50], num_rows).astype(np.int32)
    if big_k:
        top_k[3] = TOP_FILTER_CANDIDATES + 44
    top_p = rng.choice([1.0, 0.5, 0.9, 0.99], num_rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], num_rows).astype(np.float32)
    k = np.where(top_k > 0, np.minimum(top_k, vocab_size), vocab_size)
    candidates = jax.lax.top_k(logits, min(TOP_FILTER_CANDIDATES, vocab_size))[0]
    row_lse = jax.nn.logsumexp(logits, axis=-1)
    _, exact = _top_k_top_p_threshold(candidates, k, top_p, row_lse, vocab_size)
    assert bool(np.all(exact)) is fast_path
    got = np.isfinite(np.asarray(jax.jit(apply_top_filters)(logits, top_k, top_p, min_p)))
    for i in range(num_rows):
        ref = _top_filter_reference(logits[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
        # float32 vs float64 cumsums may differ on the one token at the top_p boundary
        assert (got[i] != ref).sum() <= 1, (i, top_k[i], top_p[i], min_p[i])


@pytest.mark.parametrize("params", [SamplingParams(top_k=3), SamplingParams(top_p=0.3),
                                    SamplingParams(min_p=0.2), SamplingParams(top_k=10, top_p=0.5, min_p=0.1)],
                         ids=["top_k", "top_p", "min_p", "all"])
def test_filtered_tokens_are_never_sampled(params):
    vocab_size, num_rows = VOCAB, 256
    logits = np.tile(_logits(1, vocab_size, seed=5, scale=1.0), (num_rows, 1))
    allowed = _top_filter_reference(logits[0], params.top_k, params.top_p, params.min_p)
    seen = set()
    for step in range(8):
        out = _run(logits, [_row(params, seed=s, step=step) for s in range(num_rows)])
        seen |= set(out.token_ids.tolist())
    assert seen <= set(np.flatnonzero(allowed).tolist())
    assert len(seen) == min(allowed.sum(), len(seen)) and len(seen) > 1


@pytest.mark.parametrize("temperature,extra", [(1.0, {}), (0.5, {}), (2.0, {}), (0.8, {"top_k": 6})])
def test_sampling_frequencies_match_softmax(temperature, extra):
    vocab_size, num_rows, num_steps = VOCAB, 256, 16
    base = _logits(1, vocab_size, seed=11, scale=1.0)[0]
    logits = np.tile(base, (num_rows, 1))
    params = SamplingParams(temperature=temperature, **extra)
    counts = np.zeros(vocab_size)
    for step in range(num_steps):
        out = _run(logits, [_row(params, seed=1000 + s, step=step) for s in range(num_rows)])
        counts += np.bincount(out.token_ids, minlength=vocab_size)
    scaled = base / temperature
    if "top_k" in extra:
        scaled = np.where(_top_filter_reference(base, extra["top_k"], 1.0, 0.0), scaled, -np.inf)
    expected = np.exp(_log_softmax(scaled[None])[0]) * counts.sum()
    assert counts[expected == 0].sum() == 0
    # Chi-square needs expected counts >= 5: lump the rare tokens into one bin.
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    keep = wanted > 0
    from scipy.stats import chisquare

    assert chisquare(observed[keep], wanted[keep]).pvalue > 1e-4


def test_gumbel_noise_statistics_and_independence():
    seeds = jnp.arange(64, dtype=jnp.uint32)
    noise = np.asarray(gumbel_noise(seeds, jnp.zeros(64, jnp.int32), 4096), np.float64)
    assert abs(noise.mean() - np.euler_gamma) < 0.01
    assert abs(noise.var() - np.pi**2 / 6) < 0.03
    corr = np.corrcoef(noise[:8])  # rows of neighbouring seeds
    assert np.abs(corr[~np.eye(8, dtype=bool)]).max() < 0.06
    lag = np.corrcoef(noise[:, :-1].ravel(), noise[:, 1:].ravel())[0, 1]  # neighbouring tokens
    assert abs(lag) < 0.01
    again = np.asarray(gumbel_noise(seeds[5:6], jnp.zeros(1, jnp.int32), 4096))
    np.testing.assert_array_equal(again[0], noise[5].astype(np.float32))


def _penalty_reference(logits: np.ndarray, prompt: list[int], output: list[int],
                       params: SamplingParams) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for t in seen:
        rp = params.repetition_penalty
        out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
    counts = np.bincount(output, minlength=len(logits))
    out -= params.frequency_penalty * counts
    out -= params.presence_penalty * (counts > 0)
    return out


def test_penalties_match_numpy():
    vocab_size = VOCAB
    rng = np.random.default_rng(2)
    logits = _logits(8, vocab_size, seed=4)
    rows, refs = [], []
    for i in range(7):
        params = SamplingParams(temperature=0.0, repetition_penalty=float(rng.uniform(0.5, 2.0)),
                                frequency_penalty=float(rng.uniform(-2, 2)),
                                presence_penalty=float(rng.uniform(-2, 2)))
        prompt = rng.integers(0, vocab_size, rng.integers(1, 10)).tolist()
        output = rng.integers(0, vocab_size, rng.integers(0, 15)).tolist()
        rows.append(_row(params, prompt=prompt, output=output))
        refs.append(_penalty_reference(logits[i], prompt, output, params))
    rows.append(_row(SamplingParams(temperature=0.0)))  # a row without penalties in the same batch
    refs.append(logits[7].astype(np.float64))
    md = SamplingMetadata.build(rows, 8, MAX_MODEL_LEN)
    assert md.use_penalties and md.all_greedy and md.token_history.shape == (8, MAX_MODEL_LEN)
    from jaxserve.sample.sampler import apply_penalties

    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), md))
    np.testing.assert_allclose(got, np.stack(refs), rtol=1e-5, atol=1e-5)
    out = jax.device_get(sample_jit(jnp.asarray(logits), md))
    np.testing.assert_array_equal(out.token_ids, np.stack(refs).argmax(-1))


def test_logit_bias_and_min_tokens_suppression():
    vocab_size = VOCAB
    logits = np.zeros((8, vocab_size), np.float32)
    logits[:, 3] = 10.0
    eos = 3
    rows = [
        _row(SamplingParams(temperature=0.0, logit_bias={9: 20.0})),  # bias beats the max
        _row(SamplingParams(temperature=0.0, logit_bias={3: -100.0, 5: 1.0})),
        _row(SamplingParams(temperature=0.0, min_tokens=2, eos_token_ids=(eos,)), output=[1]),
        _row(SamplingParams(temperature=0.0, min_tokens=2, eos_token_ids=(eos,)), output=[1, 1]),
        _row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True,
                            logit_bias={5: 50.0}, eos_token_ids=(eos,))),  # eos kept, 5 suppressed
        _row(SamplingParams(temperature=0.0), suppress=[3, 0]),  # explicit suppress list
    ]
    out = _run(logits, rows)
    assert out.token_ids[:6].tolist() == [9, 5, 0, 3, 3, 1]
    assert out.logprobs[0] < np.log(0.5)  # raw logprob: bias not included


def _seeded_params() -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1234)


def test_seeded_sampling_independent_of_batch_position_and_composition():
    vocab_size = VOCAB
    target = _logits(1, vocab_size, seed=9, scale=0.5)
    alone = _run(target, [_row(_seeded_params(), seed=1234, step=7)])
    others = _logits(8, vocab_size, seed=10)
    others[5] = target[0]
    rng = np.random.default_rng(0)
    rows = [_row(SamplingParams(temperature=float(rng.uniform(0.2, 2)), top_p=0.8,
                                repetition_penalty=1.3), seed=int(rng.integers(1 << 31)),
                 step=int(rng.integers(100)), output=[1, 2]) for _ in range(8)]
    rows[5] = _row(_seeded_params(), seed=1234, step=7)
    batched = _run(others, rows)  # other static variant (penalties, top filters) too
    in_16 = _run(np.concatenate([others, others]), rows + rows, num_rows_padded=16)
    assert alone.token_ids[0] == batched.token_ids[5] == in_16.token_ids[5] == in_16.token_ids[13]
    steps = [_run(target, [_row(_seeded_params(), seed=1234, step=s)]).token_ids[0] for s in range(20)]
    assert len(set(steps)) > 5  # the step moves the key on


def test_large_and_negative_seeds_are_accepted():
    logits = _logits(2, VOCAB)
    rows = [_row(SamplingParams(temperature=1.0), seed=2**32 - 1),
            _row(SamplingParams(temperature=1.0), seed=-5)]
    md = SamplingMetadata.build_host(rows, 8, MAX_MODEL_LEN)
    assert md.seeds[:2].tolist() == [2**32 - 1, 2**32 - 5]
    out = _run(logits, rows)
    assert (0 <= out.token_ids).all() and (out.token_ids < VOCAB).all()


def test_builder_flags_padding_and_caps():
    greedy, hot = SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.7)
    md = SamplingMetadata.build_host([_row(greedy), (hot, 1, 0, [1], [], None)], 8, MAX_MODEL_LEN)
    assert (md.all_greedy, md.use_penalties, md.use_top_filters) == (False, False, False)
    assert md.token_history.shape == (8, 1) and md.temperature[1] == np.float32(0.7)
    assert (md.temperature[2:] == 0).all() and (md.suppress_ids == -1).all()
    md = SamplingMetadata.build_host([_row(SamplingParams(top_p=0.5))], 8, MAX_MODEL_LEN)
    assert md.use_top_filters and not md.all_greedy
    md = SamplingMetadata.build_host([], 8, MAX_MODEL_LEN)
    assert md.all_greedy and not md.use_top_filters
    too_many_bias = SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.build_host([_row(too_many_bias)], 8, MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingMetadata.build_host(
            [_row(SamplingParams(min_tokens=1, stop_token_ids=list(range(MAX_SUPPRESS_IDS + 1))))],
            8, MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="num_rows_padded"):
        SamplingMetadata.build_host([_row(hot)] * 9, 8, MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="max_model_len"):
        SamplingMetadata.build_host([_row(SamplingParams(presence_penalty=1.0),
                                          output=[1] * MAX_MODEL_LEN)], 8, MAX_MODEL_LEN)


def test_no_recompilation_for_new_data_with_same_shapes_and_flags():
    for md in SamplingMetadata.warmup_variants(8, MAX_MODEL_LEN):
        sample_jit(jnp.zeros((8, VOCAB)), md)
    num_compiled = sample_jit._cache_size()
    rng = np.random.default_rng(0)
    for trial in range(12):
        rows = [_row(SamplingParams(
            temperature=float(rng.choice([0.0, 0.7])), top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 5])), min_p=float(rng.choice([0.0, 0.1])),
            presence_penalty=float(rng.choice([0.0, 0.5])), logit_bias={int(rng.integers(VOCAB)): 1.0}),
            seed=int(rng.integers(1 << 40)), step=trial,
            prompt=rng.integers(0, VOCAB, 5).tolist(), output=rng.integers(0, VOCAB, 3).tolist())
            for _ in range(int(rng.integers(1, 9)))]
        md = SamplingMetadata.build(rows, 8, MAX_MODEL_LEN)
        jax.block_until_ready(sample_jit(jnp.asarray(_logits(8, VOCAB, seed=trial)), md))
    assert sample_jit._cache_size() == num_compiled


def test_warmup_variants_are_six_distinct_programs():
    fn = jax.jit(lambda logits, md: sample(logits, md))  # a cache of its own
    variants = SamplingMetadata.warmup_variants(8, MAX_MODEL_LEN)
    flags = {(md.all_greedy, md.use_penalties, md.use_top_filters) for md in variants}
    assert len(flags) == len(variants) == 6
    for md in variants:
        jax.eval_shape(fn, jax.ShapeDtypeStruct((8, VOCAB), jnp.float32), md)


def test_token_bitmask_masks_rows_without_a_new_program():
    """Bit t of word t // 32 allows token t (llguidance's layout); an all -1 batch is untouched, and
    the mask rides in the same compiled program (a lax.cond, no new variant)."""
    from jaxserve.sample.sampler import apply_token_bitmask

    words = -(-VOCAB // 32)
    logits = jnp.asarray(_logits(8, VOCAB, seed=3))
    bitmask = np.full((8, words), -1, np.int32)
    bitmask[1] = 0
    bitmask[1, 5 // 32] |= 1 << 5
    bitmask[1, 37 // 32] |= 1 << (37 % 32)
    bitmask[2, :] = 0
    bitmask[2, (VOCAB - 1) // 32] = np.array(1 << ((VOCAB - 1) % 32), np.uint32).view(np.int32)
    masked = np.asarray(apply_token_bitmask(logits, jnp.asarray(bitmask)))
    assert set(np.flatnonzero(np.isfinite(masked[1]))) == {5, 37}
    assert set(np.flatnonzero(np.isfinite(masked[2]))) == {VOCAB - 1}
    np.testing.assert_array_equal(masked[0], np.asarray(logits)[0])
    fn = jax.jit(lambda logits, md: sample(logits, md))  # a cache of its own
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)]
    rows = [_row(params[i % 2]) for i in range(3)]
    free = SamplingMetadata.build(rows, 8, MAX_MODEL_LEN, num_mask_words=words)
    unconstrained = np.asarray(fn(logits, free).token_ids)
    md = SamplingMetadata.build(rows, 8, MAX_MODEL_LEN, bitmask[:3], num_mask_words=words)
    constrained = np.asarray(fn(logits, md).token_ids)
    assert fn._cache_size() == 1
    assert constrained[1] in (5, 37) and constrained[2] == VOCAB - 1 and constrained[0] == unconstrained[0]


def test_greedy_head_in_vocabulary_slices_matches_the_whole_head():
    """The CPU sampler's plain greedy path (_sample_step with vocab_slices) against the whole
    [S, V] head: same tokens (ties to the first index, across slices), logprobs and ranks; a batch
    that asks for more (a logit bias, top logprobs) takes the whole head, in the same program."""
    from jaxserve.sample.sampler import SLICED_MIN_ROWS, vocab_slices
    from jaxserve.worker.programs import _sample_step
    rng = np.random.default_rng(5)
    num_rows, hidden_size = SLICED_MIN_ROWS, 16
    embed = rng.standard_normal((VOCAB, hidden_size)).astype(np.float32)
    embed[100] = embed[3]  # a tie across slices (32 tokens each): the first index wins
    hidden = rng.standard_normal((num_rows, hidden_size)).astype(np.float32)
    hidden[:8] = 6 * embed[[3, 100, 40, 64, 65, 127, 0, 31]]  # maxima at slice edges, and the tie
    params = {"embed": jnp.asarray(embed)}
    assert vocab_slices(VOCAB, target=32) == 4 and vocab_slices(49152) == 12 and vocab_slices(50257) == 0

    def both(rows):
        md = SamplingMetadata.build(rows, num_rows, MAX_MODEL_LEN)
        return [jax.device_get(_sample_step(params, jnp.asarray(hidden), md, num_rows=num_rows, vocab_slices=n)[0])
                for n in (0, 4)]

    whole, sliced = both([_row(SamplingParams(temperature=0.0)) for _ in range(num_rows)])
    logits = hidden.astype(np.float64) @ embed.T.astype(np.float64)
    logits[:, 100] = logits[:, 3]  # the same column: a BLAS may round the two differently (seen on CI)
    np.testing.assert_array_equal(whole.token_ids, logits.argmax(-1))
    assert whole.token_ids[0] == whole.token_ids[1] == 3
    np.testing.assert_array_equal(sliced.token_ids, whole.token_ids)
    np.testing.assert_allclose(sliced.logprobs, whole.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sliced.ranks, whole.ranks)
    np.testing.assert_array_equal(sliced.top_ids, whole.top_ids)
    np.testing.assert_array_equal(sliced.top_logprobs, whole.top_logprobs)
    for asks in ({"logit_bias": {7: 100.0}}, {"logprobs": 2}):
        rows = [_row(SamplingParams(temperature=0.0, **(asks if i == 5 else {}))) for i in range(num_rows)]
        whole, sliced = both(rows)
        assert asks.get("logit_bias") is None or whole.token_ids[5] == 7
        for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(sliced)):
            np.testing.assert_array_equal(a, b)


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("head", ["tied", "untied", "int8"])
def test_greedy_head_slices_of_every_head_and_in_bfloat16(head):
    """The sliced greedy sampler takes an untied float lm_head and a per-channel int8 one (columns of
    values and scales) as it takes a tied embedding: same tokens, logprobs and ranks as the whole
    head. With head_dots (the CPU's bfloat16 dots) it runs below SLICED_MIN_ROWS too, and gives
    the argmax and log-softmax of bfloat16 x bfloat16 products summed in float32."""
    from jaxserve.quantization.quantize import quantize_weight
    from jaxserve.sample.sampler import SLICED_MIN_ROWS
    from jaxserve.worker.model_runner import _head_slices
    from jaxserve.worker.programs import _sample_step
    rng = np.random.default_rng(7)
    hidden_size = 16
    embed = rng.standard_normal((VOCAB, hidden_size)).astype(np.float32)
    w = rng.standard_normal((hidden_size, VOCAB)).astype(np.float32)  # [H, V]
    params = {"embed": jnp.asarray(embed)}
    if head == "untied":
        params["lm_head"] = jnp.asarray(w)
    elif head == "int8":
        params["lm_head"] = quantize_weight(jnp.asarray(w))
    # the runner slices every such head (at a real vocabulary's size), not an fp8 one
    big = {"embed": jnp.zeros((49152, hidden_size))}
    if head != "tied":
        big["lm_head"] = jnp.zeros((hidden_size, 49152))
    if head == "int8":
        big["lm_head"] = quantize_weight(big["lm_head"])
        assert _head_slices({**big, "lm_head": dataclasses.replace(big["lm_head"], scheme="fp8")}, None, None) == 0
        q = params["lm_head"]
        values, scales = np.asarray(q.values, np.float64), np.asarray(q.scales, np.float64)[0]
    assert _head_slices(big, None, None) == 12
    for num_rows in (8, SLICED_MIN_ROWS):
        hidden = rng.standard_normal((num_rows, hidden_size)).astype(np.float32)
        md = SamplingMetadata.build([_row(SamplingParams(temperature=0.0)) for _ in range(num_rows)], num_rows,
                                    MAX_MODEL_LEN)
        run = lambda **kw: jax.device_get(_sample_step(params, jnp.asarray(hidden), md, num_rows=num_rows, **kw)[0])
        whole, sliced, dots = run(), run(vocab_slices=4), run(vocab_slices=4, head_dots=True)
        if num_rows >= SLICED_MIN_ROWS:  # float32 products in slices: the whole head's result
            np.testing.assert_array_equal(sliced.token_ids, whole.token_ids)
            np.testing.assert_allclose(sliced.logprobs, whole.logprobs, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(sliced.ranks, whole.ranks)
        x = _bf16(hidden)  # bfloat16 operands, exact products and sums
        if head == "tied":
            ref = x @ _bf16(embed).T
        elif head == "untied":
            ref = x @ _bf16(w)
        else:  # W8A16: the int8 values are exact in bfloat16, the scales after the sum
            ref = (x @ values) * scales
        ref_logprob = -np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1))  # of the max
        gap = np.sort(ref, -1)[:, -1] - np.sort(ref, -1)[:, -2]
        clear = gap > 1e-3  # rows whose top two are not within float32 rounding of each other
        assert clear.sum() >= num_rows - 1
        np.testing.assert_array_equal(dots.token_ids[clear], ref.argmax(-1)[clear])
        np.testing.assert_allclose(dots.logprobs, ref_logprob, rtol=1e-4, atol=1e-4)
        assert (dots.ranks == 1).all()
        # not the float32 head's logits: bfloat16 rounding moved the logprobs
        assert np.abs(dots.logprobs - whole.logprobs).max() > 1e-6
