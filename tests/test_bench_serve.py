"""`jaxserve bench serve` end to end against the fake engine behind the real HTTP server (fast)."""

from __future__ import annotations

import json

import pytest

from jaxserve.bench.plots import plot_sweep
from jaxserve.bench.sweep import parse_values, recommend, table
from jaxserve.cli import main as cli_main
from jaxserve.entrypoints.openai.api_server import build_app
from tests.fake_engine import FakeAsyncLLM, serve_in_thread

# Keys of vLLM's `vllm bench serve` result JSON that jaxserve's must share.
VLLM_KEYS = ["date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
             "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
             "ttfts", "itls", "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests"]
VLLM_KEYS += [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")]


@pytest.fixture(scope="module")
def url():
    with serve_in_thread(build_app(FakeAsyncLLM(step_delay=0.002))) as base:
        yield base


def _run(tmp_path, url, *extra: str) -> dict:
    argv = ["bench", "serve", "--base-url", url, "--num-prompts", "10", "--random-input-len", "8",
            "--random-output-len", "5", "--ignore-eos", "--disable-tqdm", "--result-dir", str(tmp_path),
            "--result-filename", "r.json", *extra]
    assert cli_main(argv) == 0
    return json.loads((tmp_path / "r.json").read_text())


def test_serve_completions_json(tmp_path, url, capsys):
    res = _run(tmp_path, url, "--max-concurrency", "3", "--goodput", "ttft:5000", "tpot:5000",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99")
    missing = [k for k in VLLM_KEYS if k not in res]
    assert not missing, missing
    assert res["completed"] == 10 and res["failed"] == 0 and res["errors"] == [""] * 10
    assert res["model_id"] == "fake-model" and res["backend"] == "openai" and res["tokenizer_id"] == "server"
    assert res["output_lens"] == [5] * 10 and res["total_output_tokens"] == 50
    assert res["input_lens"] == [8] * 10 and res["total_input_tokens"] == 80
    assert all(len(i) == 4 for i in res["itls"]) and all(t > 0 for t in res["ttfts"])
    assert 1 <= res["max_concurrent_requests"] <= 3 and res["max_concurrency"] == 3
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["p50_e2el_ms"] > 0 and res["p99_tpot_ms"] >= res["p50_tpot_ms"]
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 E2EL (ms):" in out and "Request goodput" in out


def test_serve_chat_text_prompts_poisson(tmp_path, url):
    res = _run(tmp_path, url, "--endpoint", "/v1/chat/completions", "--request-rate", "200", "--seed", "3")
    assert res["backend"] == "openai-chat" and res["completed"] == 10 and res["request_rate"] == 200.0
    assert all(isinstance(t, str) and t for t in res["generated_texts"])
    assert res["output_lens"] == [5] * 10


def test_serve_reports_failures(tmp_path, url):
    # The fake server refuses prompts over its max_model_len (64): every timed request fails, but
    # the test request (same prompt) fails first, so the run stops with a clear message.
    with pytest.raises(SystemExit, match="test request"):
        cli_main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--random-input-len", "100",
                  "--disable-tqdm"])


def test_sweep_helpers_and_plots(tmp_path):
    assert parse_values("max-num-seqs", "4, 8") == ("max_num_seqs", [4, 8])
    assert parse_values("enable-chunked-prefill", "on,off")[1] == [True, False]
    with pytest.raises(ValueError, match="param"):
        parse_values("no-such-flag", "1")
    rows = [{"value": 4, "output_throughput": 50.0, "p99_ttft_ms": 800.0},
            {"value": 8, "output_throughput": 80.0, "p99_ttft_ms": 1500.0},
            {"value": 16, "output_throughput": 95.0, "p99_ttft_ms": 4000.0}]
    rec = recommend(rows, "max-num-seqs", ttft_slo_ms=2000.0)
    assert "max-num-seqs=8" in rec["chat"] and "max-num-seqs=16" in rec["batch"]
    assert "no value meets" in recommend(rows, "max-num-seqs", ttft_slo_ms=100.0)["chat"]
    for p in plot_sweep(rows, "max_num_seqs", tmp_path):
        assert p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"
    full = [{**r, "request_throughput": 1.0, "median_ttft_ms": 1.0, "mean_tpot_ms": None, "p99_itl_ms": 2.0,
             "duration": 3.0} for r in rows]
    assert table(full, "max-num-seqs").count("\n") == 4
