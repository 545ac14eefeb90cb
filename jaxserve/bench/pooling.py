"""`jaxserve bench serve --endpoint /v1/embeddings` (or /rerank, /score): vLLM's embedding and
rerank backends. Each request is one non-streamed POST; what counts is requests/s and input
tokens/s (the server's `usage`), and each request's latency.

    dataset prompts --(--embed-batch-size texts a request; rerank: 1 query + the texts as documents)-->
    POST at --request-rate, at most --max-concurrency in flight -> result dict (vLLM's keys)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from datetime import datetime

import httpx
import numpy as np
from tqdm.auto import tqdm

from jaxserve.bench import datasets as ds
from jaxserve.bench.arrivals import arrival_delays

POOLING_ENDPOINTS = ("/v1/embeddings", "/rerank", "/v1/rerank", "/v2/rerank", "/score")


def build_payload(endpoint: str, model: str, texts: list[str]) -> dict[str, object]:
    if endpoint == "/v1/embeddings":
        return {"model": model, "input": texts if len(texts) > 1 else texts[0]}
    if endpoint == "/score":
        return {"model": model, "text_1": texts[0], "text_2": texts[1:] or texts}
    return {"model": model, "query": texts[0], "documents": texts[1:] or texts}


async def _send(client: httpx.AsyncClient, url: str, payload: dict) -> tuple[float, int, str | None]:
    start = time.perf_counter()
    try:
        r = await client.post(url, json=payload)
    except httpx.HTTPError as exc:
        return time.perf_counter() - start, 0, f"{type(exc).__name__}: {exc}"
    latency = time.perf_counter() - start
    if r.status_code != 200:
        return latency, 0, f"HTTP {r.status_code}: {r.text[:500]}"
    usage = r.json().get("usage") or {}
    return latency, int(usage.get("prompt_tokens") or usage.get("total_tokens") or 0), None


async def run_load(url: str, payloads: list[dict], request_rate: float, max_concurrency: int | None,
                   headers: dict[str, str], progress: bool, seed: int) -> tuple[list, float]:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(payloads), desc="bench serve", unit="req", disable=not progress)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), headers=headers,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        async def one(payload: dict):
            if sem is not None:
                await sem.acquire()
            try:
                return await _send(client, url, payload)
            finally:
                if sem is not None:
                    sem.release()
                bar.update(1)

        start = time.perf_counter()
        tasks = []
        for payload, at in zip(payloads, arrival_delays(len(payloads), request_rate, 1.0, seed)):
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(payload)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def run(args: argparse.Namespace, base_url: str, model: str, headers: dict[str, str]) -> dict[str, object]:
    tokenizer_id = getattr(args, "tokenizer", None)
    tokenizer = ds.load_local_tokenizer(tokenizer_id) if tokenizer_id else ds.WordTokenizer()
    requests = ds.build_requests(args, tokenizer, False)
    texts = [r.prompt if isinstance(r.prompt, str) else " ".join(map(str, r.prompt)) for r in requests]
    per = max(1, getattr(args, "embed_batch_size", 1))
    payloads = [build_payload(args.endpoint, model, texts[i:i + per]) for i in range(0, len(texts), per)]
    url = base_url.rstrip("/") + args.endpoint
    results, duration = asyncio.run(run_load(url, payloads, args.request_rate, args.max_concurrency, headers,
                                             not args.disable_tqdm, args.seed))
    ok = [r for r in results if r[2] is None]
    lat = np.array([r[0] for r in ok]) * 1000 if ok else np.zeros(1)
    tokens = sum(r[1] for r in ok)
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-embeddings"
            if args.endpoint == "/v1/embeddings" else "vllm-rerank", "endpoint": args.endpoint, "base_url": base_url,
            "model_id": model, "num_prompts": len(texts), "num_requests": len(payloads), "completed": len(ok),
            "failed": len(results) - len(ok), "duration": duration,
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "max_concurrency": args.max_concurrency, "total_input_tokens": tokens,
            "request_throughput": len(ok) / duration, "input_throughput": tokens / duration,
            "texts_throughput": sum(1 for _ in ok) * per / duration,
            "mean_e2el_ms": float(lat.mean()), "median_e2el_ms": float(np.median(lat)),
            "p99_e2el_ms": float(np.percentile(lat, 99)),
            "errors": [r[2] for r in results if r[2] is not None][:10]}


def format_result(res: dict[str, object]) -> str:
    rows = [("Successful requests:", res["completed"]), ("Failed requests:", res["failed"]),
            ("Benchmark duration (s):", res["duration"]), ("Total input tokens:", res["total_input_tokens"]),
            ("Request throughput (req/s):", res["request_throughput"]),
            ("Input token throughput (tok/s):", res["input_throughput"]),
            ("Mean E2EL (ms):", res["mean_e2el_ms"]), ("Median E2EL (ms):", res["median_e2el_ms"]),
            ("P99 E2EL (ms):", res["p99_e2el_ms"])]
    lines = ["{s:{c}^{n}}".format(s=" Pooling Benchmark Result ", n=50, c="=")]
    lines += [f"{k:<40}" + (f"{v:<10.2f}" if isinstance(v, float) else f"{v!s:<10}") for k, v in rows]
    return "\n".join(lines + ["=" * 50])
