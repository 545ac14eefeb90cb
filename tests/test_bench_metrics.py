"""bench arithmetic against hand-computed values: percentiles, TPOT, goodput, the result keys."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.bench import datasets as ds
from jaxserve.bench.metrics import (RequestResult, calculate_metrics, format_percentile, meets_slos, parse_goodput,
                                    percentile)
from jaxserve.bench.serve import arrival_delays


def test_percentile_linear_interpolation():
    values = [10.0, 20.0, 30.0, 40.0]
    # rank = q/100 * (n-1): p50 -> 1.5 -> 25; p99 -> 2.97 -> 30 + 0.97*10 = 39.7; p10 -> 0.3 -> 13
    assert percentile(values, 50) == pytest.approx(25.0)
    assert percentile(values, 99) == pytest.approx(39.7)
    assert percentile(values, 10) == pytest.approx(13.0)
    assert percentile([], 99) == 0.0
    assert format_percentile(99.0) == "99" and format_percentile(99.9) == "99.9"


def _results() -> list[RequestResult]:
    # r0: ttft 0.1 s, 5 tokens, e2el 0.5 s -> tpot (0.5-0.1)/4 = 0.1 s; itl 4 x 0.1
    # r1: ttft 0.3 s, 3 tokens, e2el 0.9 s -> tpot 0.3 s; itl 0.2, 0.4
    # r2: ttft 0.2 s, 1 token, e2el 0.2 s -> no tpot
    # r3: failed
    return [RequestResult(True, 10, 5, 0.1, [0.1] * 4, 0.5, 0.0),
            RequestResult(True, 20, 3, 0.3, [0.2, 0.4], 0.9, 0.0),
            RequestResult(True, 30, 1, 0.2, [], 0.2, 0.0),
            RequestResult(False, 40, 0, error="HTTP 500")]


def test_calculate_metrics_by_hand():
    m = calculate_metrics(_results(), duration=2.0, percentiles=(50.0, 99.0),
                          goodput_slos_ms={"ttft": 250.0, "tpot": 150.0})
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # 200 + 0.98 * 100
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # (100 + 300) / 2
    assert m["p50_tpot_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(1000 * (0.4 + 0.6) / 6)
    assert m["p99_itl_ms"] == pytest.approx(400.0 - 0.05 * 200.0)  # rank 4.95 of [.1,.1,.1,.1,.2,.4]
    assert m["mean_e2el_ms"] == pytest.approx(1600.0 / 3)
    # goodput: r0 (ttft 100, tpot 100) and r2 (ttft 200, 1 token) meet it; r1 (ttft 300) does not
    assert m["request_goodput"] == pytest.approx(1.0)


def test_goodput_parsing_and_slos():
    assert parse_goodput(["ttft:200", "e2el:1500.5"]) == {"ttft": 200.0, "e2el": 1500.5}
    for bad in (["ttft"], ["foo:1"], ["tpot:x"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    r = RequestResult(True, 1, 3, 0.1, [0.05, 0.05], 0.2)
    assert meets_slos(r, {"ttft": 100.0, "tpot": 50.0, "e2el": 200.0})
    assert not meets_slos(r, {"tpot": 49.0})
    assert calculate_metrics(_results(), 1.0)["request_goodput"] is None


def test_arrivals_poisson_and_inf():
    assert arrival_delays(4, float("inf"), 1.0, 0) == [0.0] * 4
    d = arrival_delays(2000, 10.0, 1.0, 0)
    assert d[0] == 0.0 and all(b >= a for a, b in zip(d, d[1:]))
    assert d[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate


def test_datasets_lengths():
    tok = ds.WordTokenizer()
    reqs = ds.random_requests(tok, 50, 20, 10, range_ratio=0.5, seed=1)
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.expected_output_len <= 15 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    again = ds.random_requests(tok, 50, 20, 10, range_ratio=0.5, seed=1)
    assert [r.prompt for r in reqs] == [r.prompt for r in again]
    pre = ds.prefix_repetition_requests(tok, 8, prefix_len=6, suffix_len=3, num_prefixes=2, output_len=4)
    assert len({tuple(r.prompt[:6]) for r in pre}) == 2 and all(r.prompt_len == 9 for r in pre)
    mixed = ds.mixed_requests(tok, 100, 64, 64, 0.7, 256, seed=0)
    assert all(4 <= r.prompt_len <= 256 and 4 <= r.expected_output_len <= 256 for r in mixed)


def test_sharegpt_file(tmp_path):
    import json

    conv = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    data = [conv("time year people way day", "man thing woman life child world"), conv("a b", "c d e f g"),
            {"conversations": [{"from": "human", "value": "only one turn"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = ds.sharegpt_requests(str(path), ds.WordTokenizer(), 1)
    assert reqs[0].prompt_len == 5 and reqs[0].expected_output_len == 6 and isinstance(reqs[0].prompt, str)
    with pytest.raises(ValueError, match="dataset_path"):
        ds.sharegpt_requests(str(path), ds.WordTokenizer(), 2)


def _dataset_args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    ds.add_dataset_args(p)
    return p.parse_args(list(argv))


def test_lognormal_lengths_median_clip_seed():
    tok = ds.WordTokenizer()
    reqs = ds.lognormal_requests(tok, 2000, 128, 64, sigma=0.7, seed=0)
    ins, outs = np.array([r.prompt_len for r in reqs]), np.array([r.expected_output_len for r in reqs])
    # the median of 2000 log-normal draws is within ~2% (1 sd) of the true one
    assert np.median(ins) == pytest.approx(128, rel=0.08) and np.median(outs) == pytest.approx(64, rel=0.08)
    assert ins.min() >= 16 and ins.max() <= 1024 and outs.min() >= 16 and outs.max() <= 512  # default ranges
    assert np.std(np.log(ins)) == pytest.approx(0.7, rel=0.1)  # barely clipped at these medians
    assert all(len(r.prompt) == r.prompt_len and all(isinstance(t, int) for t in r.prompt) for r in reqs[:20])
    same = ds.lognormal_requests(tok, 2000, 128, 64, sigma=0.7, seed=0)
    assert [(r.prompt, r.expected_output_len) for r in reqs] == [(r.prompt, r.expected_output_len) for r in same]
    other = ds.lognormal_requests(tok, 2000, 128, 64, sigma=0.7, seed=1)
    assert [r.prompt_len for r in other] != list(ins)
    # a wide sigma and narrow ranges: every length clipped into them, both ends reached
    wide = ds.lognormal_requests(tok, 300, 40, 40, sigma=2.0, input_range="30:50", output_range=(1, 40), seed=2)
    assert {min(r.prompt_len for r in wide), max(r.prompt_len for r in wide)} == {30, 50}
    assert {min(r.expected_output_len for r in wide), max(r.expected_output_len for r in wide)} == {1, 40}
    flat = ds.lognormal_requests(tok, 5, 33.4, 7, sigma=0.0, seed=0)  # sigma 0: the median, rounded and clipped
    assert [(r.prompt_len, r.expected_output_len) for r in flat] == [(33, 16)] * 5
    text = ds.lognormal_requests(tok, 10, 20, 20, seed=3, as_ids=False)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == r.prompt_len for r in text)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sigma=-0.1), "lognormal_sigma: must be >= 0"),
    (dict(input_range="100:10"), "lognormal_input_range: LO must be <= HI"),
    (dict(input_range="0:10"), "lognormal_input_range: LO must be >= 1"),
    (dict(input_range="16-1024"), "lognormal_input_range: must be LO:HI"),
    (dict(input_range="1:2:3"), "lognormal_input_range: must be LO:HI"),
    (dict(output_range="a:b"), "lognormal_output_range: must be LO:HI"),
    (dict(output_range="9:8"), "lognormal_output_range: LO must be <= HI"),
    (dict(input_median=0), "random_input_len"),
])
def test_lognormal_bad_values(kwargs, match):
    args = dict(input_median=64, output_median=64) | kwargs
    with pytest.raises(ValueError, match=match):
        ds.lognormal_requests(ds.WordTokenizer(), 4, **args)


def test_lognormal_flags():
    args = _dataset_args("--dataset-name", "lognormal")
    assert (args.lognormal_sigma, args.lognormal_input_range, args.lognormal_output_range) == (0.7, "16:1024", "16:512")
    args = _dataset_args("--dataset-name", "lognormal", "--num-prompts", "200", "--random-input-len", "20",
                         "--random-output-len", "10", "--lognormal-sigma", "1.5", "--lognormal-input-range", "8:32",
                         "--lognormal-output-range", "4:12", "--seed", "5")
    reqs = ds.build_requests(args, ds.WordTokenizer(), as_ids=True)
    assert len(reqs) == 200 and all(8 <= r.prompt_len <= 32 and 4 <= r.expected_output_len <= 12 for r in reqs)
    direct = ds.lognormal_requests(ds.WordTokenizer(), 200, 20, 10, 1.5, "8:32", "4:12", seed=5)
    assert [r.prompt for r in reqs] == [r.prompt for r in direct]
    with pytest.raises(ValueError, match="lognormal_sigma"):
        ds.build_requests(_dataset_args("--dataset-name", "lognormal", "--lognormal-sigma", "-1"), ds.WordTokenizer(),
                          as_ids=True)
