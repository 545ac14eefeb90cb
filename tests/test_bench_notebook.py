"""notebooks/bench_analysis.ipynb runs top to bottom (nbclient) on small result files and draws its plots."""

from __future__ import annotations

import json
from pathlib import Path

from jaxserve.bench.metrics import RequestResult, calculate_metrics

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "bench_analysis.ipynb"


def _serve_result() -> dict:
    results = [RequestResult(True, 8, 4, 0.1 * (i + 1), [0.02, 0.03, 0.02], 0.1 * (i + 1) + 0.07) for i in range(4)]
    res = calculate_metrics(results, 1.0)
    return {**res, "model_id": "m", "max_concurrent_requests": 4, "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results]}


def test_notebook_executes(tmp_path, monkeypatch):
    import nbclient
    import nbformat

    (tmp_path / "serve.json").write_text(json.dumps(_serve_result()))
    batching = {"speedup_continuous_over_static": 2.0,
                "continuous": {"output_tokens_per_second": 20.0, "kv_waste_paged": 0.03,
                               "kv_waste_reserved_max_model_len": 0.7, "kv_waste_reserved_max_tokens": 0.3},
                "static": {"output_tokens_per_second": 10.0}}
    (tmp_path / "batching.json").write_text(json.dumps(batching))
    rows = [{"value": v, "output_throughput": 10.0 * v, "p99_ttft_ms": 100.0 * v} for v in (1, 2)]
    (tmp_path / "sweep.json").write_text(json.dumps({"mode": "serve", "param": "max_num_seqs", "rows": rows,
                                                     "recommendation": {}}))
    out = tmp_path / "plots"
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setenv("BENCH_PLOTS_OUT", str(out))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent.parent)}}).execute()
    assert sorted(p.name for p in out.glob("*.png")) == [
        "batching.png", "serve_latency_cdf.png", "sweep_max_num_seqs_throughput_vs_ttft.png",
        "sweep_max_num_seqs_vs_param.png"]
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "continuous/static = 2.00x" in text
