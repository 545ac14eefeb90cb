"""`jaxserve bench sweep`: one engine parameter over a grid, the rest fixed.

    --mode serve       per value: start `jaxserve serve --PARAM VALUE ...` as a subprocess,
                       wait for /health, run `bench serve` against it, stop it
    --mode throughput  per value: an in-process engine on weights loaded once, `bench throughput`

Writes sweep.json, sweep.md (the table) and two PNGs (throughput against TTFT p99;
both against the parameter) to --output-dir, and prints a recommendation: for a chat
workload the highest throughput whose TTFT p99 meets --ttft-slo-ms, for a batch
workload the highest throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jaxserve.bench import datasets as ds
from jaxserve.bench import serve as bench_serve
from jaxserve.bench.plots import plot_sweep
from jaxserve.bench.throughput import add_engine_args, engine_kwargs, run_throughput
from jaxserve.entrypoints.cli_args import ENGINE_FIELDS

COLUMNS = ("value", "output_throughput", "request_throughput", "p99_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
           "p99_itl_ms", "duration")


def parse_values(param: str, values: str) -> tuple[str, list[object]]:
    """("max-num-seqs", "4,8") -> ("max_num_seqs", [4, 8]); typed from EngineArgs; ValueError names the field."""
    name = param.replace("-", "_")
    if name not in ENGINE_FIELDS:
        raise ValueError(f"param: {param!r} is not an engine argument")
    kind = ENGINE_FIELDS[name][0]
    out: list[object] = []
    for raw in values.split(","):
        raw = raw.strip()
        if kind is bool:
            if raw.lower() not in ("true", "false", "on", "off", "1", "0"):
                raise ValueError(f"values: {raw!r} is not a boolean for {param}")
            out.append(raw.lower() in ("true", "on", "1"))
        else:
            try:
                out.append(kind(raw))
            except ValueError:
                raise ValueError(f"values: {raw!r} is not a {kind.__name__} for {param}") from None
    return name, out


def _flag(name: str, value: object) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


def start_server(name: str, value: object, port: int, extra: list[str], log_path: Path,
                 timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--uvicorn-log-level", "warning", *_flag(name, value), *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"the server did not become healthy in {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _row(value: object, res: dict) -> dict[str, object]:
    if "output_tokens_per_second" in res:  # an offline throughput result
        res = {**res, "output_throughput": res["output_tokens_per_second"],
               "request_throughput": res["requests_per_second"], "duration": res["elapsed_time"]}
    return {c: (value if c == "value" else res.get(c)) for c in COLUMNS}


def recommend(rows: list[dict], param: str, ttft_slo_ms: float) -> dict[str, str]:
    best_batch = max(rows, key=lambda r: r["output_throughput"])
    ok = [r for r in rows if r["p99_ttft_ms"] is not None and r["p99_ttft_ms"] <= ttft_slo_ms]
    if ok:
        chat = max(ok, key=lambda r: r["output_throughput"])
        chat_text = (f"chat (TTFT p99 <= {ttft_slo_ms:.0f} ms): {param}={chat['value']} "
                     f"({chat['output_throughput']:.1f} tok/s, TTFT p99 {chat['p99_ttft_ms']:.0f} ms)")
    else:
        chat = min(rows, key=lambda r: r["p99_ttft_ms"] or math.inf)
        chat_text = (f"chat: no value meets TTFT p99 <= {ttft_slo_ms:.0f} ms; the lowest is {param}={chat['value']} "
                     f"({chat['p99_ttft_ms']:.0f} ms): lower the offered load (rate, concurrency) or add capacity")
    return {"chat": chat_text,
            "batch": f"batch (throughput): {param}={best_batch['value']} ({best_batch['output_throughput']:.1f} tok/s, "
                     f"TTFT p99 {best_batch['p99_ttft_ms']:.0f} ms)"}


def table(rows: list[dict], param: str) -> str:
    head = "| " + " | ".join([param] + list(COLUMNS[1:])) + " |"
    sep = "|" + "---|" * len(COLUMNS)

    def fmt(v: object) -> str:
        return f"{v:.1f}" if isinstance(v, float) else ("-" if v is None else str(v))

    return "\n".join([head, sep] + ["| " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |" for r in rows])


def run_sweep(args: argparse.Namespace, model=None) -> dict[str, object]:
    name, values = parse_values(args.param, args.values)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.mode == "throughput":
        from jaxserve.entrypoints.llm import LLM
        from jaxserve.weights.loader import load_model

        kwargs = engine_kwargs(args)
        model = model or load_model(kwargs.pop("model", None), kwargs.get("dtype", "auto"), not args.disable_tqdm)
        kwargs.pop("model", None)
        for value in values:
            print(f"--- {args.param}={value}", flush=True)
            llm = LLM(model, progress=not args.disable_tqdm, **{**kwargs, name: value})
            requests = ds.build_requests(args, ds.HFTokenizer(llm.get_tokenizer()), as_ids=True)
            rows.append(_row(value, run_throughput(llm, requests, progress=not args.disable_tqdm)))
            del llm
    else:
        extra = shlex.split(args.server_args or "")
        for i, value in enumerate(values):
            print(f"--- {args.param}={value}: starting jaxserve serve", flush=True)
            proc = start_server(name, value, args.port, extra, out_dir / f"server-{name}-{value}.log",
                                args.startup_timeout)
            try:
                ns = argparse.Namespace(**vars(args))
                ns.base_url, ns.model = f"http://127.0.0.1:{args.port}", None
                res = bench_serve.run(ns)
            finally:
                stop_server(proc)
            (out_dir / f"serve-{name}-{value}.json").write_text(json.dumps(res, indent=1))
            print(bench_serve.format_result(res), flush=True)
            rows.append(_row(value, res))
    plots = plot_sweep(rows, name, out_dir, f"{args.mode} sweep of {args.param}")
    rec = recommend(rows, args.param, args.ttft_slo_ms)
    result = {"mode": args.mode, "param": name, "values": values, "rows": rows, "recommendation": rec,
              "plots": [str(p) for p in plots]}
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=1))
    (out_dir / "sweep.md").write_text(table(rows, args.param) + "\n\n" + rec["chat"] + "\n\n" + rec["batch"] + "\n")
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("serve", "throughput"), default="serve")
    p.add_argument("--param", required=True, help="an engine flag, e.g. max-num-seqs, enable-chunked-prefill")
    p.add_argument("--values", required=True, help="comma-separated, e.g. 4,8,16 or on,off")
    p.add_argument("--output-dir", default="bench-sweep")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="the chat workload's TTFT p99 target")
    p.add_argument("--server-args", default="", help="more `jaxserve serve` flags, one string (serve mode)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--startup-timeout", type=float, default=1200.0)
    p.add_argument("--endpoint", default="/v1/completions", choices=bench_serve.ENDPOINTS)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    ds.add_dataset_args(p)
    add_engine_args(p)  # throughput mode: the fixed engine settings


def main(args: argparse.Namespace) -> int:
    # bench serve's flags that sweep fixes
    defaults = dict(host="127.0.0.1", api_key=None, prompt_format="auto", temperature=0.0, goodput=None,
                    percentile_metrics="ttft,tpot,itl", metric_percentiles="99")
    for k, v in defaults.items():
        setattr(args, k, getattr(args, k, v))
    try:
        res = run_sweep(args)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"bench sweep: {exc}") from None
    print(table(res["rows"], args.param))  # type: ignore[arg-type]
    print("recommendation:\n  " + res["recommendation"]["chat"] + "\n  " + res["recommendation"]["batch"])  # type: ignore[index]
    print("plots: " + ", ".join(res["plots"]))  # type: ignore[arg-type]
    return 0

