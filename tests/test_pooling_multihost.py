"""A decoder embedder on two hosts (`jaxserve serve --num-hosts 2`, one device each, TP 2 over both):
it runs on the generation runner, so the multi-host step relay carries its pooling rows as it carries
a generation step; the embeddings equal sentence-transformers', rank 1 serves no HTTP, SIGTERM stops both."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import sentence_transformers as st

from tests.pooling_fixtures import make_qwen3_embedder
from tests.test_multihost import ENV, ROOT, TIMEOUT_S, _tail, free_port

pytestmark = pytest.mark.multidevice  # two processes joined by jax.distributed: make test-fast skips it

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c", "Paris is the capital of France."]


def test_a_decoder_embedder_on_two_hosts(tmp_path) -> None:
    model_dir = make_qwen3_embedder(tmp_path / "qwen3", tmp_path / "qwen3_raw")
    ref = st.SentenceTransformer(model_dir, device="cpu").encode(TEXTS, convert_to_numpy=True)
    coord, http = free_port(), free_port()
    logs = [tmp_path / f"serve{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", model_dir, "--num-hosts", "2", "--host-rank", str(r),
               "--coordinator", f"127.0.0.1:{coord}", "--tensor-parallel-size", "2", "--dtype", "float32",
               "--max-model-len", "32", "--max-num-seqs", "2", "--compilation-cache-dir", "",
               "--host", "127.0.0.1", "--port", str(http)]
        with open(logs[r], "wb") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT))
    base = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            for r, p in enumerate(procs):
                assert p.poll() is None, f"rank {r} exited early:\n{_tail(logs[r])}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no /health after {TIMEOUT_S} s:\n{_tail(logs[0])}"
            time.sleep(0.5)
        body = httpx.post(f"{base}/v1/embeddings", json={"input": TEXTS}, timeout=120)
        assert body.status_code == 200, body.text
        got = np.array([d["embedding"] for d in body.json()["data"]], np.float32)
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)  # float32, TP 2 over two processes
        procs[0].send_signal(signal.SIGTERM)
        for r, p in enumerate(procs):
            assert p.wait(60) == 0, f"rank {r}:\n{_tail(logs[r])}"
        assert "Uvicorn running" not in logs[1].read_text(errors="replace")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
