"""PNG plots of bench results (matplotlib, Agg backend): used by `sweep` and the analysis notebook."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, out_path: str | Path, dpi: int) -> Path:
    """Lay out, write (making the folder) and close `fig`; the path written."""
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def plot_sweep(rows: list[dict], param: str, out_dir: str | Path, title: str = "") -> list[Path]:
    """rows: {"value", "output_throughput", "p99_ttft_ms", ...} per parameter value. Two PNGs:
    throughput against TTFT p99 (each point labelled with its value), and both against the parameter."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = [str(r["value"]) for r in rows]
    tput = [r["output_throughput"] for r in rows]
    ttft = [r["p99_ttft_ms"] for r in rows]

    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(ttft, tput, "o-")
    for x, y, label in zip(ttft, tput, labels):
        ax.annotate(f"{param}={label}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title or f"throughput vs TTFT p99 over {param}")
    ax.grid(alpha=0.3)
    p1 = out / f"sweep_{param}_throughput_vs_ttft.png"
    fig.tight_layout()
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, ax1 = plt.subplots(figsize=(6, 4.5))
    x = np.arange(len(rows))
    ax1.plot(x, tput, "o-", color="tab:blue", label="output tokens/s")
    ax1.set_ylabel("output tokens/s", color="tab:blue")
    ax1.set_xticks(x, labels)
    ax1.set_xlabel(param)
    ax2 = ax1.twinx()
    ax2.plot(x, ttft, "s--", color="tab:red", label="TTFT p99 (ms)")
    ax2.set_ylabel("TTFT p99 (ms)", color="tab:red")
    ax1.set_title(title or f"tokens/s and TTFT p99 vs {param}")
    ax1.grid(alpha=0.3)
    p2 = out / f"sweep_{param}_vs_param.png"
    fig.tight_layout()
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def plot_serve_latencies(result: dict, out_path: str | Path) -> Path:
    """CDFs of TTFT, ITL and E2E-ish latency (ms) of one `bench serve` result JSON."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ttfts = np.sort(np.asarray(result["ttfts"], dtype=float) * 1000)
    itls = np.sort(np.asarray([x for r in result["itls"] for x in r], dtype=float) * 1000)
    for ax, data, name in ((axes[0], ttfts, "TTFT"), (axes[1], itls, "ITL")):
        if data.size:
            ax.plot(data, np.arange(1, data.size + 1) / data.size)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name == "TTFT" else "fraction of tokens")
        ax.set_title(f"{name} CDF ({result.get('model_id', '')})")
        ax.grid(alpha=0.3)
    return _save(plt, fig, out_path, dpi=110)


def plot_batching(result: dict, out_path: str | Path) -> Path:
    """Bars: output tokens/s per mode, and KV waste (paged vs reserved) of continuous batching."""
    plt = _plt()
    modes = [k for k in ("continuous", "static", "hf") if k in result]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(modes, [result[m]["output_tokens_per_second"] for m in modes], color="tab:blue")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"continuous / static = {result['speedup_continuous_over_static']:.2f}x")
    c = result["continuous"]
    names = ["paged", "reserved\nmax_model_len", "reserved\nprompt+max_tokens"]
    vals = [c["kv_waste_paged"], c["kv_waste_reserved_max_model_len"], c["kv_waste_reserved_max_tokens"]]
    ax2.bar(names, [100 * v for v in vals], color=["tab:green", "tab:red", "tab:orange"])
    ax2.set_ylabel("KV slots allocated but unused (%)")
    ax2.set_title("KV waste (continuous run)")
    return _save(plt, fig, out_path, dpi=110)


def plot_peer_comparison(result: dict, out_path: str | Path) -> Path:
    """Grouped bars: output tokens/s of each server per workload, with the rounds' range as error bars
    and each bar's ratio to `result["baseline"]` above it (the row's "ratio" when it has one, e.g. the
    median of per-round ratios, else the ratio of the medians).

    result: {"title": str, "baseline": server name, "workloads": {workload label: [{"server": str,
    "output_throughput": median, "range": [lo, hi], "ratio": optional}, ...]}} (scripts/plot_benchmarks.py writes one)."""
    plt = _plt()
    workloads = list(result["workloads"])
    servers = list(dict.fromkeys(r["server"] for rows in result["workloads"].values() for r in rows))
    width = 0.8 / len(servers)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for j, server in enumerate(servers):
        for i, workload in enumerate(workloads):
            rows = {r["server"]: r for r in result["workloads"][workload]}
            if server not in rows:
                continue
            row, base = rows[server], rows.get(result["baseline"])
            x, y = i + (j - (len(servers) - 1) / 2) * width, row["output_throughput"]
            lo, hi = row.get("range", (y, y))
            ax.bar(x, y, width * 0.92, color=f"C{j}", label=server if i == 0 else None,
                   yerr=[[y - lo], [hi - y]], capsize=3, ecolor="#333")
            if base is not None and server != result["baseline"]:
                ratio = row.get("ratio", y / base["output_throughput"])  # the table's own ratio when given
                ax.annotate(f"{ratio:.2f}x", (x, hi), textcoords="offset points",
                            xytext=(0, 3), ha="center", fontsize=8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("output tokens/s (median of rounds)")
    ax.set_title(result.get("title", ""), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    return _save(plt, fig, out_path, dpi=90)


def plot_throughput_curves(sweep: dict, out_path: str | Path, title: str = "") -> Path:
    """One `bench sweep` result (sweep.json): output tokens/s against the swept parameter (log2 axis
    for numbers), with TTFT p99 on a second axis; each point labelled with its throughput."""
    plt = _plt()
    rows = sweep["rows"]
    xs = [r["value"] for r in rows]
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in xs)
    pos = xs if numeric else list(range(len(xs)))
    tput = [r["output_throughput"] for r in rows]
    fig, ax1 = plt.subplots(figsize=(7.5, 4.2))
    ax1.plot(pos, tput, "o-", color="tab:blue", label="output tokens/s")
    for x, y in zip(pos, tput):
        ax1.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8,
                     color="tab:blue")
    if numeric:
        ax1.set_xscale("log", base=2)
    ax1.set_xticks(pos, [str(x) for x in xs])
    ax1.set_xlabel(sweep.get("param", "value").replace("_", "-"))
    ax1.set_ylabel("output tokens/s", color="tab:blue")
    ax1.set_ylim(0, max(tput) * 1.2)
    ttft = [r.get("p99_ttft_ms") for r in rows]
    if all(t is not None for t in ttft):
        ax2 = ax1.twinx()
        ax2.plot(pos, [t / 1000 for t in ttft], "s--", color="tab:red", label="TTFT p99")
        ax2.set_ylabel("TTFT p99 (s)", color="tab:red")
        ax2.set_ylim(0, max(ttft) / 1000 * 1.2)
    ax1.set_title(title or f"{sweep.get('mode', '')} sweep of {sweep.get('param', '')}", fontsize=10)
    ax1.grid(alpha=0.3)
    return _save(plt, fig, out_path, dpi=90)
