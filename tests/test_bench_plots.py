"""The plotting behind BENCHMARKS.md's pictures: jaxserve.bench.plots and scripts/plot_benchmarks.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from jaxserve.bench.plots import plot_peer_comparison, plot_throughput_curves

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _script():
    spec = importlib.util.spec_from_file_location("plot_benchmarks", ROOT / "scripts" / "plot_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peer_comparison_png(tmp_path):
    result = {"baseline": "peer", "title": "t", "workloads": {
        "A": [{"server": "peer", "output_throughput": 100.0, "range": [90.0, 110.0]},
              {"server": "jaxserve", "output_throughput": 200.0, "range": [190.0, 210.0], "ratio": 2.0}],
        "S": [{"server": "peer", "output_throughput": 50.0},
              {"server": "jaxserve", "output_throughput": 150.0}]}}
    out = plot_peer_comparison(result, tmp_path / "sub" / "peers.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("values", [[1, 2, 4, 8], ["on", "off"]])
def test_throughput_curves_png(tmp_path, values):
    rows = [{"value": v, "output_throughput": 10.0 * (i + 1), "p99_ttft_ms": 100.0 * (i + 1)}
            for i, v in enumerate(values)]
    out = plot_throughput_curves({"mode": "throughput", "param": "max_num_seqs", "rows": rows}, tmp_path / "c.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_headline_table_reads_from_benchmarks_md():
    """scripts/plot_benchmarks.py draws the headline from BENCHMARKS.md's table: it must still parse."""
    result = _script().read_peer_table(ROOT / "BENCHMARKS.md", _script().SECTION)
    assert len(result["workloads"]) == 2
    for rows in result["workloads"].values():
        servers = {r["server"]: r for r in rows}
        assert "llama.cpp" in servers and "jaxserve (no flags)" in servers
        for r in rows:
            lo, hi = r["range"]
            assert lo <= r["output_throughput"] <= hi
        assert servers["jaxserve (no flags)"]["ratio"] > 1.0


def test_throughput_dir_assembles_rows(tmp_path):
    for n, tput in ((1, 10.0), (4, 30.0)):
        (tmp_path / f"max_num_seqs_{n}.json").write_text(json.dumps({
            "output_tokens_per_second": tput, "requests_per_second": 1.0, "elapsed_time": 2.0, "p99_ttft_ms": 5.0}))
    sweep = _script().read_sweep(tmp_path)
    assert sweep["values"] == [1, 4]
    assert [r["output_throughput"] for r in sweep["rows"]] == [10.0, 30.0]
