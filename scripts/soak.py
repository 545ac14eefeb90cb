"""Soak test (not a unit test): minutes of mixed load on a real `jaxserve serve`, watching for leaks.

    .venv/bin/python scripts/soak.py                      # 15 min on the default model, 8 clients
    .venv/bin/python scripts/soak.py --minutes 3 --serve-args "--max-model-len 512 --max-num-seqs 16"
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 --pid 1234   # an already running server

Load (each client in a loop, kinds drawn at random): streamed completions, streams the client
drops after a random delay, n > 1 with sampling, chat with a JSON schema, plain chat, and bad
requests (NaN, an oversized n, broken JSON) that must be 400s. Every minute one row: the server's
RSS and open file descriptors, KV usage, requests running/waiting, p99 time to first token of
that minute's streams, requests done. At the end the load stops and the pool must return to 0
used blocks, and no request may be lost (no answer in time) or duplicated (two finishes for one
choice, two [DONE]s, the server's finished-request counter off the client's count). Exit status
1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "In 1969, the first person to walk on the moon", "A haiku about the sea:"]
BAD = ['{"prompt": "hi", "temperature": NaN}', '{"prompt": "hi", "n": 100000}', '{"prompt": ', '{"prompt": []}',
       '{"prompt": "hi", "max_tokens": -1}', '{"prompt": [999999999]}']


@dataclass
class Tally:
    completed: int = 0  # requests the engine finished (what vllm:request_success_total counts)
    dropped: int = 0  # streams this script closed before their end
    bad_ok: int = 0  # bad requests answered with a 4xx
    lost: int = 0  # no answer within the timeout, or a 5xx
    duplicated: int = 0  # a choice finished twice, two [DONE]s, repeated choice indices
    problems: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)  # this minute's streams

    def problem(self, kind: str, what: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {what}")


async def stream(http: httpx.AsyncClient, tally: Tally, model: str, drop_after: float | None) -> None:
    body = {"model": model, "prompt": random.choice(PROMPTS), "max_tokens": random.randint(8, 64),
            "stream": True, "temperature": random.choice([0.0, 0.8]), "ignore_eos": True}
    start = time.monotonic()
    finishes: dict[int, int] = {}
    dones = 0
    waiting_first = True
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            tally.lost += 1
            tally.problem("stream", f"status {r.status_code}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if drop_after is not None and time.monotonic() - start > drop_after:
                tally.dropped += 1
                return  # leaving the block closes the connection: the server must abort and free it
            if line == "data: [DONE]":
                dones += 1
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                tally.lost += 1
                tally.problem("stream", chunk["error"]["message"])
                return
            for choice in chunk["choices"]:
                if choice["finish_reason"] is not None:
                    finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
                if waiting_first and choice["text"]:
                    tally.ttfts.append(time.monotonic() - start)
                    waiting_first = False
    tally.completed += 1
    if dones != 1 or list(finishes.values()) != [1]:
        tally.duplicated += 1
        tally.problem("stream", f"[DONE] x{dones}, finishes {finishes}")


async def one(http: httpx.AsyncClient, tally: Tally, model: str) -> None:
    kind = random.choices(["stream", "drop", "n", "structured", "chat", "bad"], [3, 2, 1, 1, 1, 1])[0]
    if kind in ("stream", "drop"):
        await stream(http, tally, model, random.uniform(0.0, 2.0) if kind == "drop" else None)
        return
    if kind == "bad":
        r = await http.post("/v1/completions", content=random.choice(BAD), headers={"content-type": "application/json"})
        if 400 <= r.status_code < 500:
            tally.bad_ok += 1
        else:
            tally.lost += 1
            tally.problem("bad", f"status {r.status_code}: {r.text[:100]}")
        return
    if kind == "n":
        n = random.randint(2, 3)
        r = await http.post("/v1/completions", json={"model": model, "prompt": random.choice(PROMPTS), "n": n,
                                                     "max_tokens": 16, "temperature": 0.8})
        expect = list(range(n))
    else:
        body = {"model": model, "messages": [{"role": "user", "content": random.choice(PROMPTS)}], "max_tokens": 32}
        if kind == "structured":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
        r = await http.post("/v1/chat/completions", json=body)
        expect = [0]
    if r.status_code != 200:
        tally.lost += 1
        tally.problem(kind, f"status {r.status_code}: {r.text[:100]}")
        return
    tally.completed += 1
    choices = r.json()["choices"]
    if sorted(c["index"] for c in choices) != expect:
        tally.duplicated += 1
        tally.problem(kind, f"choice indices {[c['index'] for c in choices]}")
    if kind == "structured" and choices[0]["finish_reason"] == "stop":
        json.loads(choices[0]["message"]["content"])  # the grammar held


async def client(http: httpx.AsyncClient, tally: Tally, model: str, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await one(http, tally, model)
        except httpx.TimeoutException as exc:
            tally.lost += 1
            tally.problem("timeout", repr(exc))
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
            tally.lost += 1
            tally.problem("client", repr(exc))


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:") and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def process_stats(pid: int | None) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of the server process; (nan, -1) without a pid."""
    if pid is None:
        return float("nan"), -1
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def start_server(serve_args: str, port: int, log: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("jaxserve")
    cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), *shlex.split(serve_args)]
    print("starting:", " ".join(cmd), f"(log: {log})", flush=True)
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become healthy")


async def soak(url: str, pid: int | None, minutes: float, clients: int) -> bool:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    tally = Tally()
    before = metrics(url)
    stop = asyncio.Event()
    print(f"{'min':>4} {'rss MiB':>8} {'fds':>5} {'kv use':>7} {'run':>4} {'wait':>5} {'p99 ttft s':>10} "
          f"{'done':>6} {'dropped':>7} {'bad 4xx':>7} {'lost':>5} {'dup':>4}", flush=True)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        tasks = [asyncio.create_task(client(http, tally, model, stop)) for _ in range(clients)]
        start = time.monotonic()
        for minute in range(1, int(minutes) + 2):
            await asyncio.sleep(max(0.0, min(start + 60 * minute, start + 60 * minutes) - time.monotonic()))
            rss, fds = process_stats(pid)
            m = await asyncio.to_thread(metrics, url)
            print(f"{minute:>4} {rss:>8.0f} {fds:>5} {m['vllm:kv_cache_usage_perc']:>7.3f} "
                  f"{m['vllm:num_requests_running']:>4.0f} {m['vllm:num_requests_waiting']:>5.0f} "
                  f"{p99(tally.ttfts):>10.3f} {tally.completed:>6} {tally.dropped:>7} {tally.bad_ok:>7} "
                  f"{tally.lost:>5} {tally.duplicated:>4}", flush=True)
            tally.ttfts.clear()
            if time.monotonic() - start >= 60 * minutes - 1:
                break
        stop.set()
        await asyncio.gather(*tasks)
    deadline = time.monotonic() + 60
    while True:
        m = metrics(url)
        idle = m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == m["vllm:kv_cache_usage_perc"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    served = m.get("vllm:request_success_total", 0) - before.get("vllm:request_success_total", 0)
    # A dropped stream the engine had already finished counts there but not here: allow those.
    counter_ok = tally.completed <= served <= tally.completed + tally.dropped
    ok = idle and tally.lost == 0 and tally.duplicated == 0 and counter_ok
    rss, fds = process_stats(pid)
    print(f"end: pool back to 0 used blocks: {'yes' if idle else 'NO'} (kv {m['vllm:kv_cache_usage_perc']:.3f}); "
          f"completed {tally.completed}, server counted {served:.0f} finished (+ up to {tally.dropped} dropped "
          f"late): {'ok' if counter_ok else 'MISMATCH'}; lost {tally.lost}; duplicated {tally.duplicated}; "
          f"rss {rss:.0f} MiB, fds {fds}", flush=True)
    for p in tally.problems:
        print("  problem:", p)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--url", default=None, help="an already running server (else one is started)")
    parser.add_argument("--pid", type=int, default=None, help="its process id, for RSS and file descriptors")
    parser.add_argument("--serve-args", default="", help="extra `jaxserve serve` flags when starting one")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc = start_server(args.serve_args, args.port, Path(f"/tmp/jaxserve_soak_{args.port}.log"))
        url, pid = f"http://127.0.0.1:{args.port}", proc.pid
    try:
        wait_healthy(url, proc)
        ok = asyncio.run(soak(url, pid, args.minutes, args.clients))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
