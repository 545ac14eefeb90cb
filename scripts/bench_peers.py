"""jaxserve against the servers a user would pick instead, on the same requests, one after the other.

Starts each server in turn (jaxserve, llama.cpp's llama-server, transformers serve),
waits until it answers, runs `jaxserve bench serve` against it at each concurrency,
stops it, and prints one table with jaxserve's ratios. Every server gets the same
requests: the log-normal dataset (medians 128/128, sigma 0.7, prompts clipped to
16-1024 and outputs to 16-512 tokens), all at t=0, greedy, built with jaxserve's
tokenizer of the default model (ids to jaxserve and llama.cpp, the same text to
transformers serve). Example (the first llama.cpp comparison in docs/benchmarks/log.md):

    .venv/bin/python scripts/bench_peers.py --peers jaxserve llamacpp \\
        --llama-server ~/llama.cpp/build/bin/llama-server --concurrency 16 32 --num-prompts 64

On a shared machine whose speed drifts by 20-30% within minutes, one run per peer does
not settle a ratio: `--repeat N` runs the peers in turn N times at each concurrency
(concurrency by concurrency, peers interleaved) and adds the median of each round's
ratio to the table.

transformers serve rejects `ignore_eos`, so it is served from a copy of the HF
directory whose generation_config has no eos token (it then also runs every
request to its max_tokens); pass that directory as --hf-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jaxserve.bench.sweep import stop_server

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def default_gguf() -> str:
    from jaxserve.weights.loader import default_model_path
    return str(default_model_path())


# jaxserve peers: the flags each adds to `jaxserve serve` (before --jaxserve-args)
JAXSERVE_PEERS = {"jaxserve": [], "jaxserve-int8": ["--quantization", "int8"],
                  "jaxserve-bf16": ["--dtype", "bfloat16"],  # bfloat16 weights (the CPU default: float32)
                  # int8 weights; on one CPU device the defaults add n-gram drafts (k = 4)
                  "jaxserve-cpu": ["--quantization", "int8", "--kv-cache-dtype", "bfloat16", "--block-size", "64"],
                  # the same, with n-gram speculative decoding in the batch's tail (drafts take the
                  # sampler rows no request uses, so at most 32 rows: --max-num-seqs 32)
                  "jaxserve-cpu-ngram": ["--quantization", "int8", "--kv-cache-dtype", "bfloat16", "--block-size", "64",
                                         "--max-num-seqs", "32", "--speculative-config",
                                         '{"method": "ngram", "num_speculative_tokens": 4}']}


# The workloads of BENCHMARKS.md's CPU tables (issue 24's S and A).
WORKLOADS = {"S": dict(input_len=64, output_len=64, num_prompts=32, concurrency=[16]),
             "A": dict(input_len=128, output_len=128, num_prompts=64, concurrency=[32])}


def server_command(peer: str, args, port: int) -> list[str]:
    if peer in JAXSERVE_PEERS:
        return [str(Path(PY).parent / "jaxserve"), "serve", *JAXSERVE_PEERS[peer], *(args.jaxserve_args or []),
                "--host", "127.0.0.1", "--port", str(port)]
    if peer == "llamacpp":
        if not args.llama_server:
            raise SystemExit("--llama-server PATH is needed for the llamacpp peer")
        return [args.llama_server, "-m", args.gguf or default_gguf(), "-np", str(max(args.concurrency)),
                "-c", str(2048 * max(args.concurrency)), "-t", str(args.threads), "-cb",
                "--host", "127.0.0.1", "--port", str(port)]
    if peer == "transformers":
        if not args.hf_dir:
            raise SystemExit("--hf-dir DIR is needed for the transformers peer")
        return [str(Path(PY).parent / "transformers"), "serve", args.hf_dir, "--continuous-batching",
                "--cb-max-batch-tokens", "512", "--cb-num-blocks", "64", "--device", "cpu",
                "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    raise SystemExit(f"unknown peer {peer!r}")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"server not ready after {timeout} s")


def bench(peer: str, url: str, concurrency: int, args, name: str) -> dict:
    cmd = [str(Path(PY).parent / "jaxserve"), "bench", "serve", "--base-url", url,
           "--endpoint", "/v1/completions", "--dataset-name", "lognormal", "--tokenizer", "default",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--lognormal-sigma", "0.7",
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
           "--seed", str(args.seed), "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", args.result_dir,
           "--result-filename", name, "--disable-tqdm"]
    if peer == "transformers":
        cmd += ["--prompt-format", "text"]  # and no --ignore-eos: it answers 422 to the field
    else:
        cmd += ["--ignore-eos"]
    if peer == "llamacpp" or peer == "transformers":
        cmd += ["--model", args.served_name.get(peer, "default")]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((Path(args.result_dir) / name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", nargs="+", default=["jaxserve", "llamacpp"],
                   choices=[*JAXSERVE_PEERS, "llamacpp", "transformers"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[16, 32])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="median prompt tokens (log-normal)")
    p.add_argument("--output-len", type=int, default=128, help="median output tokens (log-normal)")
    p.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="a named workload of BENCHMARKS.md; sets the lengths, --num-prompts and --concurrency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--threads", type=int, default=2, help="llama-server threads")
    p.add_argument("--gguf", default=None, help="llama-server's model (default: the default model's GGUF); "
                   "with jaxserve on another model too, pass it in --jaxserve-args --model DIR")
    p.add_argument("--hf-dir", default=None, help="HF-format directory for transformers serve")
    p.add_argument("--jaxserve-args", nargs=argparse.REMAINDER, default=None,
                   help="flags for jaxserve serve (last on the line)")
    p.add_argument("--result-dir", default=str(ROOT / "docs" / "perf"))
    p.add_argument("--tag", default="", help="prefix of the result files")
    p.add_argument("--port", type=int, default=8041)
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every peer at each concurrency, interleaved; the table adds median ratios")
    args = p.parse_args()
    for key, value in WORKLOADS.get(args.workload, {}).items():
        setattr(args, key, value)
    args.served_name = {"transformers": args.hf_dir or ""}
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)

    results: dict[tuple[str, int, int], dict] = {}
    # One round: each peer at each concurrency, peer-major (as before --repeat). Several rounds:
    # concurrency-major with the peers interleaved, so drift hits every peer alike.
    if args.repeat == 1:
        order = [(0, peer, c) for peer in args.peers for c in args.concurrency]
    else:
        order = [(r, peer, c) for c in args.concurrency for r in range(args.repeat) for peer in args.peers]
    # A fresh server for every run: llama-server keeps each slot's last prompt and reuses it
    # for a request sharing its prefix, so a second run of the same prompts would hit its cache.
    for rnd, peer, c in order:
        stem = f"{args.tag}{peer}_c{c}" + (f"_r{rnd}" if args.repeat > 1 else "")
        cmd = server_command(peer, args, args.port)
        print("$", " ".join(cmd), flush=True)
        log = open(Path(args.result_dir) / f"{stem}_server.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        url = f"http://127.0.0.1:{args.port}"
        try:
            ready = wait_ready(url, proc, 600)
            print(f"{peer} ready in {ready:.0f} s", flush=True)
            if peer == "llamacpp":
                args.served_name["llamacpp"] = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            results[(peer, c, rnd)] = bench(peer, url, c, args, stem + ".json")
        finally:
            stop_server(proc)
            log.close()

    print(f"\n| server | concurrency | completed | input tok | output tok | duration s | output tok/s | "
          f"total tok/s | TTFT median ms | TPOT median ms | ITL median ms | jaxserve output tok/s ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (peer, c, rnd), r in results.items():
        ratio = ", ".join(f"{j} {results[(j, c, rnd)]['output_throughput'] / r['output_throughput']:.2f}x"
                          for j in JAXSERVE_PEERS if (j, c, rnd) in results and peer not in JAXSERVE_PEERS)
        if args.repeat > 1:
            peer = f"{peer} (round {rnd + 1})"
        print(f"| {peer} | {c} | {r['completed']}/{r['num_prompts']} | {r['total_input_tokens']} | "
              f"{r['total_output_tokens']} | {r['duration']:.1f} | {r['output_throughput']:.1f} | "
              f"{r['total_token_throughput']:.1f} | {r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.0f} | "
              f"{r['median_itl_ms']:.0f} | {ratio} |")
    if args.repeat > 1:
        print()
        for c in args.concurrency:
            for j in JAXSERVE_PEERS:
                for peer in args.peers:
                    if peer in JAXSERVE_PEERS:
                        continue
                    ratios = [results[(j, c, r)]["output_throughput"] / results[(peer, c, r)]["output_throughput"]
                              for r in range(args.repeat) if (j, c, r) in results and (peer, c, r) in results]
                    if ratios:
                        print(f"concurrency {c}: {j} / {peer} output tok/s, median of {len(ratios)} rounds "
                              f"{statistics.median(ratios):.2f}x (rounds: {', '.join(f'{x:.2f}x' for x in ratios)})")


if __name__ == "__main__":
    main()
