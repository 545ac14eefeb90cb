"""`jaxserve bench serve`: an asyncio load generator for any OpenAI-compatible server.

    build requests (dataset; prompts built with --tokenizer, a local tokenizer, so every
      server gets the same ones; else with the server's /tokenize as ids, else words as text)
      -> one test request (fails fast on a wrong URL or model)
      -> send at --request-rate (Poisson arrivals; inf = all at once), at most
         --max-concurrency in flight, each streamed: TTFT at the first content
         chunk, ITL between chunks, token count from the final usage chunk
         (stream_options.include_usage), else the number of content chunks
      -> metrics.calculate_metrics -> printed table + vLLM-compatible JSON

--structured-output-ratio R (the name of vLLM's structured-output benchmark) constrains that
share of the requests, spread evenly over the list, to a JSON schema (`structured_outputs`,
vLLM's request field; --structured-output-schema FILE, else STRUCTURED_SCHEMA). Those requests
are never sent `ignore_eos` (their grammar ends them); the result counts how many of their
outputs parse as JSON. Run once with R = 0 and once with R > 0 to price the grammar.

JAX is never imported (except by the GGUF reader behind `--tokenizer default` or a .gguf):
this measures servers, it does not run one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import time
from datetime import datetime
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from jaxserve.bench import datasets as ds
from jaxserve.bench.arrivals import arrival_delays  # noqa: F401  (bench serve's public helper)
from jaxserve.bench.pooling import POOLING_ENDPOINTS
from jaxserve.bench.metrics import (DEFAULT_PERCENTILES, RequestResult, calculate_metrics, format_percentile,
                                    parse_goodput)

GENERATE_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ENDPOINTS = GENERATE_ENDPOINTS + POOLING_ENDPOINTS  # the pooling ones: jaxserve/bench/pooling.py
# The default schema of --structured-output-ratio: open-ended enough that a model writes at length.
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8},
    "steps": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "minutes": {"type": "integer", "minimum": 0, "maximum": 600}},
        "required": ["name", "minutes"]}}},
    "required": ["title", "tags", "steps"]}


def structured_indices(num_requests: int, ratio: float) -> set[int]:
    """The requests to constrain: round(ratio * n) of them, spread evenly (ratio 0.5: every other)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"structured_output_ratio: must be in [0, 1], got {ratio}")
    return {i for i in range(num_requests) if math.floor((i + 1) * ratio + 1e-9) > math.floor(i * ratio + 1e-9)}


class ServerTokenizer:
    """A server's own tokenizer through /tokenize and /detokenize (vLLM's and jaxserve's extension)."""

    def __init__(self, base_url: str, model: str | None, timeout: float = 30.0) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout)
        self.model = model

    def encode(self, text: str) -> list[int]:
        r = self.http.post("/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def decode(self, token_ids: list[int]) -> str:
        r = self.http.post("/detokenize", json={"model": self.model, "tokens": list(token_ids)})
        r.raise_for_status()
        return r.json()["prompt"]

    def works(self) -> bool:
        try:
            return bool(self.encode("hello world")) and isinstance(self.decode(self.encode("hello")), str)
        except (httpx.HTTPError, KeyError, ValueError):
            return False


def discover_model(base_url: str, headers: dict[str, str]) -> str:
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"model: {base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def build_payload(endpoint: str, model: str, req: ds.SampleRequest, ignore_eos: bool,
                  temperature: float, schema: dict | None = None) -> dict[str, object]:
    """One streamed request; `schema`: constrain it (`structured_outputs`, no ignore_eos)."""
    body: dict[str, object] = {"model": model, "temperature": temperature, "stream": True,
                               "stream_options": {"include_usage": True}}
    if endpoint.endswith("/chat/completions"):
        content = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        if req.multi_modal_data:  # random-mm: the text, then the images (vLLM's order)
            content = [{"type": "text", "text": content}, *req.multi_modal_data]
        body.update(messages=[{"role": "user", "content": content}], max_completion_tokens=req.expected_output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.expected_output_len)
    if schema is not None:
        body["structured_outputs"] = {"json": schema}  # vLLM's extension field
    elif ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension; plain OpenAI servers may refuse it
    return body


def _chunk_text(chunk: dict, chat: bool) -> str | None:
    choices = chunk.get("choices") or []
    if not choices:
        return None
    if chat:
        return (choices[0].get("delta") or {}).get("content")
    return choices[0].get("text")


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, req: ds.SampleRequest,
                       chat: bool) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    result.start_time = start
    num_chunks, usage = 0, None
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:500]}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:500]
                    return result
                usage = chunk.get("usage") or usage
                text = _chunk_text(chunk, chat)
                if text:  # a content chunk (the role-only and usage chunks carry none)
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_chunks += 1
                    pieces.append(text)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = last - start
    result.generated_text = "".join(pieces)
    result.output_len = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") is not None \
        else num_chunks
    if usage and usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    result.success = num_chunks > 0 or result.output_len == 0
    if not result.success:
        result.error = "the stream ended without any content"
    return result


async def run_load(base_url: str, endpoint: str, model: str, requests: list[ds.SampleRequest], *,
                   request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
                   ignore_eos: bool = False, temperature: float = 0.0, seed: int = 0,
                   headers: dict[str, str] | None = None, progress: bool = True,
                   test_request: bool = True, structured: set[int] = frozenset(),
                   schema: dict | None = None, models: list[str] | None = None) -> tuple[list[RequestResult], float, int]:
    """Send every request (those at the `structured` indices constrained to `schema`); returns
    (results in request order, duration s, peak requests in flight). `models`: each request names
    one of them, drawn at random (seeded), as vLLM's bench with --lora-modules; else `model`."""
    picks = random.Random(seed).choices(models, k=len(requests)) if models else [model] * len(requests)
    chat = endpoint.endswith("/chat/completions")
    url = base_url.rstrip("/") + endpoint
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=limits, headers=headers) as client:
        if test_request:
            first = requests[0]
            probe = dataclasses.replace(first, expected_output_len=min(first.expected_output_len, 4))
            res = await send_request(client, url, build_payload(endpoint, model, probe, ignore_eos, temperature),
                                     probe, chat)
            if not res.success:
                raise RuntimeError(f"the test request to {url} failed: {res.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        state = {"in_flight": 0, "peak": 0}
        bar = tqdm(total=len(requests), desc="bench serve", unit="req", disable=not progress)

        async def one(i: int, req: ds.SampleRequest) -> RequestResult:
            payload = build_payload(endpoint, picks[i], req, ignore_eos, temperature,
                                    schema if i in structured else None)
            if sem is not None:
                await sem.acquire()
            state["in_flight"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])
            try:
                return await send_request(client, url, payload, req, chat)
            finally:
                state["in_flight"] -= 1
                if sem is not None:
                    sem.release()
                bar.update(1)

        delays = arrival_delays(len(requests), request_rate, burstiness, seed)
        start = time.perf_counter()
        tasks = []
        for i, (req, at) in enumerate(zip(requests, delays)):
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration, state["peak"]


def run(args: argparse.Namespace) -> dict[str, object]:
    """The whole `bench serve` run as a result dict (also what `sweep` calls)."""
    if args.endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint: must be one of {ENDPOINTS}, got {args.endpoint!r}")
    if getattr(args, "dataset_name", None) == "random-mm" and not args.endpoint.endswith("/chat/completions"):
        raise ValueError("dataset_name: random-mm sends its images as chat content parts: use "
                         "--endpoint /v1/chat/completions")
    if getattr(args, "dataset_name", None) == "random-mm":
        from jaxserve.bench.random_mm import check_args

        check_args(args)  # a bad flag fails before the server is asked anything
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # The prompts' tokenizer and its name (the result's tokenizer_id): --tokenizer (loaded first, so a bad
    # one fails before any request), else the server's /tokenize, else words. `bench sweep` has no --tokenizer.
    tokenizer_id = getattr(args, "tokenizer", None)
    tokenizer: ds.Tokenizer | None = ds.load_local_tokenizer(tokenizer_id) if tokenizer_id else None
    model = args.model or discover_model(base_url, headers)
    if args.endpoint in POOLING_ENDPOINTS:
        from jaxserve.bench import pooling

        return pooling.run(args, base_url, model, headers)
    if tokenizer is None:
        server_tok = ServerTokenizer(base_url, model)
        tokenizer, tokenizer_id = (server_tok, "server") if server_tok.works() else (ds.WordTokenizer(), "words")
    chat = args.endpoint.endswith("/chat/completions")
    # auto: ids for /v1/completions unless the lengths are only word counts; text for chat
    as_ids = args.prompt_format == "ids" or (args.prompt_format == "auto" and not chat
                                             and not isinstance(tokenizer, ds.WordTokenizer))
    requests = ds.build_requests(args, tokenizer, as_ids)
    ratio = getattr(args, "structured_output_ratio", 0.0)
    structured = structured_indices(len(requests), ratio)
    schema_file = getattr(args, "structured_output_schema", None)
    schema = json.loads(Path(schema_file).read_text()) if schema_file else STRUCTURED_SCHEMA
    slos = parse_goodput(args.goodput)
    results, duration, peak = asyncio.run(run_load(
        base_url, args.endpoint, model, requests, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
        seed=args.seed, headers=headers, progress=not args.disable_tqdm, structured=structured, schema=schema,
        models=getattr(args, "lora_modules", None) or getattr(args, "models", None)))
    metrics = calculate_metrics(results, duration, percentile_metrics=tuple(args.percentile_metrics.split(",")),
                                percentiles=tuple(float(q) for q in args.metric_percentiles.split(",")),
                                goodput_slos_ms=slos)
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai",
        "endpoint": args.endpoint,
        "base_url": base_url,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "dataset_name": args.dataset_name,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "max_concurrent_requests": peak,
        "goodput_slos_ms": slos or None,
        "structured_output_ratio": ratio,
        "num_structured": len(structured),
        "structured_json_parsed": sum(_parses(results[i].generated_text) for i in structured if results[i].success),
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def format_result(res: dict[str, object]) -> str:
    """vLLM's printed table."""
    def row(label: str, value: object, fmt: str = "{:<10.2f}") -> str:
        return f"{label:<40}" + (fmt.format(value) if isinstance(value, float) else f"{value!s:<10}")

    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", res["completed"]),
             row("Failed requests:", res["failed"]),
             row("Maximum request concurrency:", res["max_concurrency"]),
             row("Peak concurrent requests:", res["max_concurrent_requests"]),
             row("Benchmark duration (s):", res["duration"]),
             row("Total input tokens:", res["total_input_tokens"]),
             row("Total generated tokens:", res["total_output_tokens"]),
             row("Request throughput (req/s):", res["request_throughput"])]
    if res["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", res["request_goodput"]))
    if res.get("num_structured"):
        lines.append(row("Structured requests (JSON parsed):", f"{res['num_structured']} "
                                                               f"({res['structured_json_parsed']})"))
    lines += [row("Output token throughput (tok/s):", res["output_throughput"]),
              row("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"]),
              row("Total token throughput (tok/s):", res["total_token_throughput"])]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in res["percentile_metrics"]:  # type: ignore[union-attr]
        lines.append("{s:{c}^{n}}".format(s=f" {titles[name]} ", n=50, c="-"))
        upper = name.upper()
        lines.append(row(f"Mean {upper} (ms):", res[f"mean_{name}_ms"]))
        lines.append(row(f"Median {upper} (ms):", res[f"median_{name}_ms"]))
        for q in res["metric_percentiles"]:  # type: ignore[union-attr]
            p = format_percentile(q)
            lines.append(row(f"P{p} {upper} (ms):", res[f"p{p}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", default=None, help="model name sent to the server (default: the first of /v1/models)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="each request names one of these adapters, at random (vLLM's bench)")
    p.add_argument("--models", nargs="+", default=None, metavar="NAME",
                   help="each request names one of these models, at random (same as --lora-modules)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, metavar="default|FILE.gguf|DIR",
                   help="build the prompts with this local tokenizer (never downloaded), so every server gets "
                        "the same requests: 'default' (jaxserve's, of its default model), a .gguf file or an HF "
                        "tokenizer directory (default: the server's /tokenize, else one word per token)")
    p.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="auto: text for /v1/chat/completions; for /v1/completions token ids when the prompts' "
                        "tokenizer is --tokenizer or the server's /tokenize, else text")
    ds.add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (default inf: all at t=0)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--structured-output-ratio", type=float, default=0.0,
                   help="share of requests constrained to a JSON schema (structured_outputs; no ignore_eos)")
    p.add_argument("--structured-output-schema", default=None, metavar="FILE.json",
                   help="the schema for --structured-output-ratio (default: a recipe-like object)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default=",".join(format_percentile(q) for q in DEFAULT_PERCENTILES))
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:100")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--embed-batch-size", type=int, default=1,
                   help="pooling endpoints: texts per request (/v1/embeddings input list, /rerank documents)")


def main(args: argparse.Namespace) -> int:
    for name in args.percentile_metrics.split(","):
        if name not in ("ttft", "tpot", "itl", "e2el"):
            raise SystemExit(f"percentile_metrics: unknown metric {name!r}")
    try:
        res = run(args)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        raise SystemExit(f"bench serve: {exc}") from None
    if args.endpoint in POOLING_ENDPOINTS:
        from jaxserve.bench import pooling

        print(pooling.format_result(res))
    else:
        print(format_result(res))
    if args.save_result or args.result_filename:
        name = args.result_filename or (f"{res['backend']}-{res['request_rate']}qps-"
                                        f"concurrency{res['max_concurrency']}-{str(res['model_id']).replace('/', '_')}"
                                        f"-{res['date']}.json")
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
        print(f"result written to {path}")
    return 0 if res["completed"] else 1
