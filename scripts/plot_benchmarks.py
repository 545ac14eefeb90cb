"""Draw the pictures at the top of BENCHMARKS.md (docs/images/*.png) with jaxserve.bench.plots.

    .venv/bin/python scripts/plot_benchmarks.py                       # the headline chart
    .venv/bin/python scripts/plot_benchmarks.py --sweep DIR/sweep.json  # and the throughput curve
    .venv/bin/python scripts/plot_benchmarks.py --sweep DIR     # DIR: `bench throughput` JSONs, max_num_seqs_N.json

The headline chart's result file is written from BENCHMARKS.md's own table (the section named by
--section: every server against llama.cpp at one commit), because the raw result files of those
runs are not kept (raw results stay out of git): the table's medians and round ranges become a
result JSON under docs/perf/ (ignored by git), which `plot_peer_comparison` draws. The throughput
curve is drawn from a `jaxserve bench sweep` result (`plot_throughput_curves`), or from one
`jaxserve bench throughput --max-num-seqs N --output-json DIR/max_num_seqs_N.json` per value (what
`bench sweep --mode throughput` runs in one process; separate processes keep each value's result
if a later one is stopped).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from jaxserve.bench.plots import plot_peer_comparison, plot_throughput_curves
from jaxserve.bench.sweep import _row

ROOT = Path(__file__).resolve().parent.parent
SECTION = "### Every server against llama.cpp: workloads A and S"
WORKLOAD_LABELS = {"A": "A: 64 requests, 128/128 tokens,\n32 concurrent (run i30)",
                   "S": "S: 32 requests, 64/64 tokens,\n16 concurrent (run i31)"}
CELL = re.compile(r"([\d.]+)\s*\(([\d.]+)-([\d.]+)\)")  # "237.3 (228.4-239.2)"


def read_peer_table(benchmarks: Path, section: str) -> dict:
    """The section's first table -> {"workloads": {label: [{"server", "output_throughput", "range"}]}}."""
    text = benchmarks.read_text(encoding="utf-8")
    start = text.index(section)
    after = text[start:].splitlines()[1:]
    first = next(i for i, ln in enumerate(after) if ln.startswith("|"))
    lines = []
    for ln in after[first:]:  # the first table only: its rows run until the first line that is not one
        if not ln.startswith("|"):
            break
        lines.append(ln)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    col = {name: i for i, name in enumerate(header)}
    workloads: dict[str, list[dict]] = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = CELL.match(cells[col["output tok/s"]])
        if m is None:
            raise ValueError(f"{benchmarks}: cannot read output tok/s from {line!r}")
        ratio = re.search(r"([\d.]+)x", cells[col["vs llama.cpp"]]) if "vs llama.cpp" in col else None
        label = WORKLOAD_LABELS.get(cells[col["workload"]], cells[col["workload"]])
        workloads.setdefault(label, []).append({
            "server": cells[col["server"]], "output_throughput": float(m.group(1)),
            "range": [float(m.group(2)), float(m.group(3))],
            **({"ratio": float(ratio.group(1))} if ratio else {})})
    return {"workloads": workloads}


def read_sweep(path: Path) -> dict:
    """A sweep.json, or a directory of `bench throughput` results named max_num_seqs_N.json."""
    if path.is_file():
        return json.loads(path.read_text())
    found = sorted((int(f.stem.rsplit("_", 1)[1]), f) for f in path.glob("max_num_seqs_*.json"))
    if not found:
        raise FileNotFoundError(f"{path}: no sweep.json and no max_num_seqs_N.json")
    rows = [_row(value, json.loads(f.read_text())) for value, f in found]
    return {"mode": "throughput", "param": "max_num_seqs", "values": [v for v, _ in found], "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--benchmarks", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--section", default=SECTION)
    p.add_argument("--sweep", default=None, help="a `jaxserve bench sweep` sweep.json, or a directory of `bench throughput` results, for the curve")
    p.add_argument("--sweep-title", default=None)
    p.add_argument("--images", default=str(ROOT / "docs" / "images"))
    p.add_argument("--results", default=str(ROOT / "docs" / "perf"), help="where the result JSON goes (git-ignored)")
    args = p.parse_args()

    result = read_peer_table(Path(args.benchmarks), args.section)
    result.update(baseline="llama.cpp", title="Output tokens/s, default model, AMD EPYC 2-core VM, commit f012d7c\n"
                                              "(median and range of 3 rounds; x: vs llama.cpp, median of the rounds' ratios)")
    Path(args.results).mkdir(parents=True, exist_ok=True)
    result_path = Path(args.results) / "headline_i30_i31.json"
    result_path.write_text(json.dumps(result, indent=1))
    print(result_path, plot_peer_comparison(result, Path(args.images) / "headline.png"))
    if args.sweep:
        sweep = read_sweep(Path(args.sweep))
        (Path(args.results) / "throughput_max_num_seqs.json").write_text(json.dumps(sweep, indent=1))
        print(plot_throughput_curves(sweep, Path(args.images) / "throughput_max_num_seqs.png", args.sweep_title or ""))


if __name__ == "__main__":
    main()
