"""`jaxserve serve` of each pooling fixture (an encoder embedder, a decoder embedder, a cross-encoder)
with the flags a generation model is served with: --tensor-parallel-size 2 --data-parallel-size 2
(4 forced CPU devices), --api-key, --max-num-queued-reqs; results against sentence-transformers, and
SIGTERM ending in-flight embedding requests as it ends completions."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import sentence_transformers as st

from tests.pooling_fixtures import DOCS, MINILM_DIR, QUERY, make_cross_encoder, make_qwen3_embedder

pytestmark = pytest.mark.multidevice  # 4 forced devices in each server process: make test-fast skips them

KEY = "pooling-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["hello world", "Crème brûlée 🤗", "the quick brown fox jumps over the lazy dog", "a b c",
         "What is the capital of France?", "Paris is the capital of France.", "Berlin is in Germany.", "x"]
FLAGS = ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--api-key", KEY, "--max-num-queued-reqs", "1",
         "--max-num-seqs", "2", "--max-model-len", "32", "--dtype", "float32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: str, log: Path, cache: Path) -> None:
        self.port, self.log = _free_port(), log
        exe = Path(sys.executable).with_name("jaxserve")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(exe), "serve", model_dir, "--host", "127.0.0.1", "--port",
                                          str(self.port), *FLAGS, "--compilation-cache-dir", str(cache)],
                                         stdout=out, stderr=subprocess.STDOUT, env=env)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, deadline: float) -> None:
        while True:
            assert self.proc.poll() is None, f"exited early:\n{self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no /health in time:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The three servers, started together (their start-ups overlap)."""
    tmp = tmp_path_factory.mktemp("pooling_serve")
    dirs = {"minilm": MINILM_DIR,
            "qwen3": make_qwen3_embedder(tmp / "qwen3", tmp / "qwen3_raw"),
            "cross": make_cross_encoder(tmp / "ce", tmp / "ce_raw")}
    # each server's second replica loads the first one's programs from its compilation cache
    started = {name: Server(d, tmp / f"{name}.log", tmp / f"xla-{name}") for name, d in dirs.items()}
    try:
        deadline = time.monotonic() + 600
        for s in started.values():
            s.wait_healthy(deadline)
        yield {name: (s, dirs[name]) for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


async def _embed_each(base: str, texts: list[str], headers: dict, at_once: int) -> list[httpx.Response]:
    """One request per text, `at_once` of them in flight at a time."""
    gate = asyncio.Semaphore(at_once)
    async with httpx.AsyncClient(base_url=base, timeout=120, headers=headers) as client:
        async def one(t: str) -> httpx.Response:
            async with gate:
                return await client.post("/v1/embeddings", json={"input": t})
        return await asyncio.gather(*(one(t) for t in texts))


@pytest.mark.parametrize("name", ["minilm", "qwen3"])
def test_embeddings_under_tp2_dp2_equal_sentence_transformers(servers, name: str) -> None:
    server, model_dir = servers[name]
    ref = st.SentenceTransformer(model_dir, device="cpu").encode(TEXTS, convert_to_numpy=True)
    # one request each, as many in flight as the 2 x 2 running slots take: both replicas serve, none waits
    answers = asyncio.run(_embed_each(server.base, TEXTS, AUTH, at_once=4))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    got = np.array([r.json()["data"][0]["embedding"] for r in answers], np.float32)
    # float32; tensor parallel sums in another order than torch: 1e-5, as on one device
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    batch = httpx.post(f"{server.base}/v1/embeddings", json={"input": TEXTS}, headers=AUTH, timeout=120).json()
    np.testing.assert_allclose(np.array([d["embedding"] for d in batch["data"]]), ref, atol=1e-5, rtol=1e-5)
    refused = httpx.post(f"{server.base}/v1/embeddings", json={"input": "no key"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["message"]
    metrics = httpx.get(f"{server.base}/metrics", headers=AUTH, timeout=30).text
    assert re.search(r"^jaxserve:xla_compilations_after_warmup_total(\{[^}]*\})? 0\.0$", metrics, re.M), metrics


def test_cross_encoder_scores_under_tp2_dp2(servers) -> None:
    server, model_dir = servers["cross"]
    ref = st.CrossEncoder(model_dir, device="cpu").predict([(QUERY, d) for d in DOCS])
    body = httpx.post(f"{server.base}/score", json={"text_1": QUERY, "text_2": DOCS}, headers=AUTH,
                      timeout=120).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], ref, atol=1e-5, rtol=1e-5)
    rerank = httpx.post(f"{server.base}/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3},
                        headers=AUTH, timeout=120).json()
    assert [r["index"] for r in rerank["results"]] == [int(i) for i in np.argsort(-ref, kind="stable")[:3]]
    assert httpx.post(f"{server.base}/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=30).status_code == 401


def test_a_burst_is_served_up_to_the_free_slots_and_the_queue(servers) -> None:
    """2 replicas x 2 free slots and a queue of 1: of 12 requests arriving together at least 5 are
    served, each right; the rest are OpenAI-shaped 503s, and the server carries on."""
    server, model_dir = servers["minilm"]
    texts = [f"burst text number {i}" for i in range(12)]
    ref = st.SentenceTransformer(model_dir, device="cpu").encode(texts, convert_to_numpy=True)
    answers = asyncio.run(_embed_each(server.base, texts, AUTH, at_once=len(texts)))
    served = [i for i, r in enumerate(answers) if r.status_code == 200]
    assert len(served) >= 5, [r.status_code for r in answers]
    for i, r in enumerate(answers):
        if r.status_code == 200:
            np.testing.assert_allclose(r.json()["data"][0]["embedding"], ref[i], atol=1e-5, rtol=1e-5)
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded", r.text
    after = httpx.post(f"{server.base}/v1/embeddings", json={"input": "after"}, headers=AUTH, timeout=60)
    assert after.status_code == 200


def test_sigterm_aborts_in_flight_embeddings_and_exits_0(servers) -> None:
    """(Last: it stops the encoder's server.) SIGTERM with --shutdown-timeout 0 (the default) during a
    request of 3,000 inputs: it ends at once with a 503 naming the abort, and the process exits 0."""
    server, _ = servers["minilm"]
    result: dict[str, httpx.Response] = {}

    def post() -> None:
        result["r"] = httpx.post(f"{server.base}/v1/embeddings", headers=AUTH, timeout=120,
                                 json={"input": [f"a long list of inputs, number {i}" for i in range(3000)]})

    thread = threading.Thread(target=post)
    thread.start()
    time.sleep(2.0)
    assert "r" not in result  # still in flight
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    thread.join(30)
    r = result["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_aborted", r.text
    assert server.proc.wait(timeout=20) == 0, server.log.read_text()[-3000:]
    assert time.monotonic() - start < 15
