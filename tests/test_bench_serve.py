"""`jaxserve bench serve` end to end against the fake engine behind the real HTTP server (fast)."""

from __future__ import annotations

import json

import pytest

from jaxserve.bench import datasets as ds
from jaxserve.bench import serve as bench_serve
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


@pytest.fixture(scope="module")
def default_tokenizer():
    return ds.load_local_tokenizer("default")


@pytest.fixture(scope="module")
def smol_url(default_tokenizer):
    """The fake engine with jaxserve's default tokenizer (SmolLM2's): the server's /tokenize, and the token
    ids it accepts, are those of a real jaxserve serving its default model."""
    engine = FakeAsyncLLM(step_delay=0.002, crash_token=None)
    engine.tokenizer = default_tokenizer.tok
    with serve_in_thread(build_app(engine)) as base:
        yield base


@pytest.fixture
def sent(monkeypatch) -> list[dict]:
    """The request bodies `bench serve` sends, the test request's first."""
    bodies: list[dict] = []
    real = bench_serve.build_payload

    def record(*args, **kwargs):
        bodies.append(real(*args, **kwargs))
        return bodies[-1]

    monkeypatch.setattr(bench_serve, "build_payload", record)
    return bodies


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


def test_serve_lognormal_dataset(tmp_path, url):
    res = _run(tmp_path, url, "--dataset-name", "lognormal", "--seed", "4", "--lognormal-input-range", "4:20",
               "--lognormal-output-range", "2:8", "--lognormal-sigma", "1.0")
    want = ds.lognormal_requests(ds.WordTokenizer(), 10, 8, 5, 1.0, "4:20", "2:8", seed=4)
    assert res["completed"] == 10 and res["dataset_name"] == "lognormal"
    assert res["input_lens"] == [r.prompt_len for r in want]
    assert res["output_lens"] == [r.expected_output_len for r in want]
    assert len(set(res["input_lens"])) > 1
    with pytest.raises(SystemExit, match="lognormal_input_range"):
        _run(tmp_path, url, "--dataset-name", "lognormal", "--lognormal-input-range", "20:4")


def test_serve_tokenizer_default_sends_its_ids(tmp_path, smol_url, default_tokenizer, sent):
    want = ds.random_requests(default_tokenizer, 10, 8, 5, seed=0, as_ids=True)
    assert all(len(r.prompt) == 8 and isinstance(r.prompt[0], int) for r in want)
    res = _run(tmp_path, smol_url, "--tokenizer", "default")
    assert res["tokenizer_id"] == "default" and res["completed"] == 10 and res["input_lens"] == [8] * 10
    assert [b["prompt"] for b in sent[1:]] == [r.prompt for r in want]  # after the test request
    # the same ids as the bench builds with jaxserve's own /tokenize
    sent.clear()
    res = _run(tmp_path, smol_url)
    assert res["tokenizer_id"] == "server" and [b["prompt"] for b in sent[1:]] == [r.prompt for r in want]


def test_serve_tokenizer_text_prompts(tmp_path, smol_url, default_tokenizer, sent):
    """Text (chat by default, or --prompt-format text) is the same ids decoded; it re-encodes to them."""
    texts = [default_tokenizer.decode(r.prompt) for r in ds.random_requests(default_tokenizer, 10, 8, 5, seed=0)]
    res = _run(tmp_path, smol_url, "--tokenizer", "default", "--prompt-format", "text")
    assert [b["prompt"] for b in sent[1:]] == texts and res["input_lens"] == [8] * 10  # counted by the server
    sent.clear()
    res = _run(tmp_path, smol_url, "--tokenizer", "default", "--endpoint", "/v1/chat/completions")
    assert [b["messages"][0]["content"] for b in sent[1:]] == texts
    assert res["tokenizer_id"] == "default" and res["backend"] == "openai-chat" and res["completed"] == 10


def test_serve_structured_output_ratio(tmp_path, url, sent, capsys):
    """Half the requests constrained (every other one), without ignore_eos; a bad ratio is refused."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    res = _run(tmp_path, url, "--structured-output-ratio", "0.5", "--structured-output-schema",
               str(tmp_path / "s.json"))
    timed = sent[1:]  # after the test request
    constrained = [i for i, b in enumerate(timed) if "structured_outputs" in b]
    assert constrained == [1, 3, 5, 7, 9]
    assert all(timed[i]["structured_outputs"] == {"json": schema} and "ignore_eos" not in timed[i]
               for i in constrained)
    assert all(b.get("ignore_eos") for i, b in enumerate(timed) if i not in constrained)
    assert res["completed"] == 10 and res["num_structured"] == 5 and res["structured_output_ratio"] == 0.5
    assert 0 <= res["structured_json_parsed"] <= 5  # the fake engine writes words, not JSON
    assert "Structured requests" in capsys.readouterr().out
    assert bench_serve.structured_indices(4, 1.0) == {0, 1, 2, 3} and bench_serve.structured_indices(4, 0.0) == set()
    assert len(bench_serve.structured_indices(64, 0.25)) == 16
    with pytest.raises(ValueError, match="structured_output_ratio"):
        bench_serve.structured_indices(4, 1.5)


def test_tokenizer_sources(tmp_path, default_tokenizer):
    """A .gguf file, or an HF tokenizer directory, gives the same requests as `default`; bad values fail clearly."""
    from jaxserve.weights.loader import default_model_path

    args = bench_serve_args("--tokenizer", "default", "--num-prompts", "4", "--random-input-len", "6")
    want = [r.prompt for r in ds.build_requests(args, default_tokenizer, as_ids=True)]
    default_tokenizer.tok.save_pretrained(str(tmp_path / "tok"))
    for source in (str(default_model_path()), str(tmp_path / "tok")):
        assert [r.prompt for r in ds.build_requests(args, ds.load_local_tokenizer(source), as_ids=True)] == want
    # prompts from the token pool decode and re-encode to the same ids (text and ids servers get the same tokens)
    for r in ds.random_requests(default_tokenizer, 20, 100, 1, seed=1):
        assert default_tokenizer.encode(default_tokenizer.decode(r.prompt)) == r.prompt
    body = bench_serve.build_payload("/v1/completions", "m", ds.SampleRequest(want[0], 6, 3), False, 0.0)
    assert body["prompt"] == want[0] and body["max_tokens"] == 3
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    (tmp_path / "empty").mkdir()
    for bad, match in ((tmp_path / "missing", "no such file"), (tmp_path / "bad.gguf", "cannot load"),
                       (tmp_path / "empty", "cannot load"), (tmp_path / "bad.gguf.txt", "no such file")):
        with pytest.raises(ValueError, match=f"^tokenizer: .*{match}"):
            ds.load_local_tokenizer(str(bad))
    # fails before any request: no server at this port
    with pytest.raises(SystemExit, match="tokenizer: .*no such file"):
        cli_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", str(tmp_path / "missing")])


def bench_serve_args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return p.parse_args(list(argv))


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
