"""Every `jaxserve bench` subcommand on the real default model, tiny sizes.

One small engine shape for all (so each later engine loads its buckets' programs from the
persistent compilation cache instead of compiling them), and a copy of the session's loaded
weights (the CLI's loader is patched to return one)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from jaxserve.cli import main as cli_main

pytestmark = pytest.mark.slow

ENGINE = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=64,
              block_size=16, dtype="float32")
ENGINE_FLAGS = [x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v))]


@pytest.fixture(autouse=True)
def cached_weights(monkeypatch, jax_default_model):
    """The CLI's engine "loads" a copy of the session's weights: an engine frees the weights it
    loaded when it shuts down, and the session's own must outlive it."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import jaxserve.engine.llm_engine as le

    def load_copy(*args, **kwargs):
        return dataclasses.replace(jax_default_model, params=jax.tree.map(jnp.copy, jax_default_model.params))

    monkeypatch.setattr(le, "load_model", load_copy)


def test_bench_throughput(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert cli_main(["bench", "throughput", "--num-prompts", "6", "--random-input-len", "16",
                     "--random-output-len", "4", "--disable-tqdm", "--output-json", str(out), *ENGINE_FLAGS]) == 0
    res = json.loads(out.read_text())
    for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second",
                "output_tokens_per_second", "p99_ttft_ms"):
        assert key in res
    assert res["num_requests"] == 6 and res["total_output_tokens"] == 24 and res["total_input_tokens"] == 96
    assert "requests/s" in capsys.readouterr().out


def test_bench_latency(tmp_path, capsys):
    out = tmp_path / "l.json"
    assert cli_main(["bench", "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                     "--num-iters", "2", "--num-iters-warmup", "1", "--disable-tqdm", "--output-json", str(out),
                     *ENGINE_FLAGS]) == 0
    res = json.loads(out.read_text())
    assert len(res["latencies"]) == 2 and set(res["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(res["latencies"]) <= res["percentiles"]["50"] <= max(res["latencies"])
    assert "99% percentile latency" in capsys.readouterr().out


@pytest.mark.warmup  # holds 0 compilations after warm-up
def test_bench_batching(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert cli_main(["bench", "batching", "--num-prompts", "10", "--input-median", "16", "--output-median", "8",
                     "--max-len", "32", "--batch-size", "4", "--disable-tqdm", "--output-json", str(out),
                     *ENGINE_FLAGS]) == 0
    res = json.loads(out.read_text())
    cont, static = res["continuous"], res["static"]
    assert cont["total_output_tokens"] == static["total_output_tokens"] == sum(res["workload"]["output_lens"])
    assert static["num_steps"] >= cont["num_steps"]  # batches wait for their longest member
    for m in (cont, static):
        assert 0.0 <= m["kv_waste_paged"] < m["kv_waste_reserved_max_model_len"]
        assert 0.0 <= m["kv_waste_reserved_max_tokens"] < m["kv_waste_reserved_max_model_len"]
    # The speedups are the ratios of the modes' measured rates, and continuous batching refills freed
    # slots, so it keeps more requests running per step than batches that wait for their longest member.
    assert res["speedup_continuous_over_static"] == pytest.approx(
        cont["output_tokens_per_second"] / static["output_tokens_per_second"])
    assert cont["mean_running"] > static["mean_running"]
    padded = res["static_padded"]
    assert padded["total_output_tokens"] == static["total_output_tokens"]  # padding decodes are not output
    assert padded["num_steps"] >= static["num_steps"]  # every member runs to its batch's longest length
    assert res["speedup_continuous_over_static_padded"] == pytest.approx(
        cont["output_tokens_per_second"] / padded["output_tokens_per_second"])
    assert padded["mean_running"] > static["mean_running"]  # finished members keep their row until the batch ends
    assert res["num_compilations_after_warmup"] == 0
    printed = capsys.readouterr().out
    assert f"continuous / static output tokens/s: {res['speedup_continuous_over_static']:.2f}x" in printed


def test_bench_sweep_throughput(tmp_path, jax_default_model):
    from jaxserve.bench.sweep import run_sweep

    args = argparse.Namespace(mode="throughput", param="max-num-seqs", values="4,8", output_dir=str(tmp_path),
                              ttft_slo_ms=60000.0, disable_tqdm=True, dataset_name="random", dataset_path=None,
                              num_prompts=6, seed=0, random_input_len=12, random_output_len=3,
                              random_range_ratio=0.0, **{k: v for k, v in ENGINE.items() if k != "max_num_seqs"})
    res = run_sweep(args, model=jax_default_model)
    assert [r["value"] for r in res["rows"]] == [4, 8]
    assert all(r["output_throughput"] > 0 and r["p99_ttft_ms"] > 0 for r in res["rows"])
    best = max(res["rows"], key=lambda r: r["output_throughput"])  # the batch workload takes the fastest value
    assert f"max-num-seqs={best['value']} " in res["recommendation"]["batch"]
    assert "max-num-seqs=" in res["recommendation"]["chat"]
    for p in res["plots"]:
        assert open(p, "rb").read(4) == b"\x89PNG"
    assert (tmp_path / "sweep.md").read_text().startswith("| max-num-seqs |")


def test_bench_serve_live_jaxserve(tmp_path, jax_default_model):
    """`bench serve` against a real jaxserve (the default model behind the OpenAI server)."""
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import serve_in_thread
    from tests.test_bench_serve import VLLM_KEYS

    engine = AsyncLLM(LLMEngine(EngineArgs(**ENGINE), model=jax_default_model, progress=False))
    try:
        with serve_in_thread(build_app(engine)) as url:
            assert cli_main(["bench", "serve", "--base-url", url, "--num-prompts", "8", "--random-input-len", "16",
                             "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "4",
                             "--disable-tqdm", "--result-dir", str(tmp_path), "--result-filename", "live.json"]) == 0
    finally:
        engine.shutdown()
    res = json.loads((tmp_path / "live.json").read_text())
    assert not [k for k in VLLM_KEYS if k not in res]
    assert res["completed"] == 8 and res["failed"] == 0
    assert res["output_lens"] == [8] * 8 and res["input_lens"] == [16] * 8
    assert res["model_id"] == "SmolLM2-135M-Instruct"  # found through the server's /v1/models
    assert res["mean_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0 and not math.isnan(res["p99_itl_ms"])
    assert 1 <= res["max_concurrent_requests"] <= 4
