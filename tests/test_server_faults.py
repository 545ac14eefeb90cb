"""Faults on the REAL engine (a tiny random Llama saved by transformers, the default model's tokenizer)
behind the OpenAI app over real HTTP: client disconnects free their blocks within a step, /metrics
tells the truth under load, a step that fails for one request's input ends that request alone,
and an exception inside a step (the engine's `fault_hook`) kills the engine: every open request
ends with an error (a 500 body, or an SSE error event then [DONE]), /health and new requests get
503; --max-num-queued-reqs refuses only what waits beyond the free slots. Last, `jaxserve serve` itself: SIGTERM during a stream ends it ("abort") and exits 0 in seconds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.engine.exceptions import EngineDeadError, RequestFailedError
from jaxserve.core.sampling_params import SamplingParams
from tests.fake_engine import serve_in_thread

pytestmark = pytest.mark.slow
TINY = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=True,
            block_size=16, num_gpu_blocks_override=40, dtype="float32", kv_cache_dtype="auto",
            speculative_config={})
LONG = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> Path:
    return tiny_llama_dir  # conftest.py: a tiny random Llama with the default model's tokenizer



@pytest.fixture(scope="module")
def served(model_dir):
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.entrypoints.openai.api_server import build_app

    engine = AsyncLLM(LLMEngine(EngineArgs(model=str(model_dir), **TINY), progress=False))
    try:
        with serve_in_thread(build_app(engine)) as url:
            yield url, engine
    finally:
        engine.shutdown()


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("vllm:") and "{" in line:
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _idle(engine) -> bool:
    stats = engine.engine.get_stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0


def test_disconnect_frees_blocks_within_a_step(served) -> None:
    url, engine = served
    pool = engine.engine.scheduler.kv
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert engine.engine.get_stats().kv_cache_usage > 0
        start = time.monotonic()
        _wait(lambda: _idle(engine), 2.0, "blocks not freed")
    assert time.monotonic() - start < 2.0
    assert pool.usage == 0 and not engine.engine.has_unfinished_requests()


def test_metrics_are_truthful_under_load(served) -> None:
    """8 streams on 4 sequence slots: 4 run, 4 wait, blocks in use; after the clients go, all 0."""
    url, engine = served

    async def load() -> dict[str, float]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def one(k: int) -> None:
                async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass

            tasks = [asyncio.ensure_future(one(k)) for k in range(8)]
            deadline = time.monotonic() + 30
            while True:
                m = await asyncio.to_thread(_metrics, url)
                if m["vllm:num_requests_running"] == 4 and m["vllm:num_requests_waiting"] == 4:
                    break
                assert time.monotonic() < deadline, m
                await asyncio.sleep(0.02)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return m

    m = asyncio.run(load())
    assert 0 < m["vllm:kv_cache_usage_perc"] <= 1
    _wait(lambda: _idle(engine), 3.0, "not idle after the clients left")
    m = _metrics(url)
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == m["vllm:kv_cache_usage_perc"] == 0


def test_a_step_failing_for_one_request_ends_it_alone(served) -> None:
    url, engine = served

    def hook(ids: list[str]) -> None:
        if "victim" in ids:
            raise RequestFailedError("victim", "victim's input broke the step")

    async def run() -> tuple[object, object]:
        params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)

        async def drain(rid: str):
            final = None
            async for out in engine.generate("Once upon a time", params, rid):
                final = out
            return final

        other = asyncio.ensure_future(drain("other"))
        await asyncio.sleep(0.05)
        return await asyncio.gather(other, drain("victim"), return_exceptions=True)

    engine.engine.fault_hook = hook
    try:
        other, victim = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        engine.engine.fault_hook = None
    assert isinstance(victim, RequestFailedError)
    assert len(other.outputs[0].token_ids) == 20 and other.outputs[0].finish_reason == "length"
    assert not engine.errored and _idle(engine)
    assert httpx.get(f"{url}/health").status_code == 200


def test_overload_refuses_only_beyond_the_free_slots_and_the_queue(served) -> None:
    """--max-num-queued-reqs 2 with 2 of the 4 slots busy: a burst of 12 gets exactly 4 answers (2 run
    at once, 2 wait) and 8 OpenAI-shaped 503s; a request admitted before is not counted as waiting
    just because the engine thread has not scheduled it yet."""
    from jaxserve.entrypoints.openai.api_server import build_app

    _, engine = served
    assert engine.max_num_seqs == TINY["max_num_seqs"] == 4

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async def busy() -> None:  # holds a slot until cancelled
                async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass

            holders = [asyncio.ensure_future(busy()) for _ in range(2)]
            deadline = time.monotonic() + 30
            while engine.get_stats().num_running < 2:
                assert time.monotonic() < deadline and not any(h.done() for h in holders)
                await asyncio.sleep(0.01)
            body = {**LONG, "max_tokens": 48}
            responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return responses

    with serve_in_thread(build_app(engine, max_num_queued_reqs=2)) as url:
        responses = asyncio.run(burst(url))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 4 + [503] * 8, codes
    for r in responses:
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] == "length"
        else:
            error = r.json()["error"]
            assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}, r.text
            assert error["code"] == "server_overloaded" and "2 requests are already waiting" in error["message"]
    _wait(lambda: _idle(engine), 10.0, "not idle after the burst")


def test_an_exception_in_a_step_kills_the_engine_and_every_request_ends(served) -> None:
    """(Last in this module: the engine is dead afterwards.)"""
    url, engine = served
    results: dict[str, object] = {}

    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            streaming.set()
            results["stream"] = [first] + [x for x in lines if x]

    def plain() -> None:
        results["plain"] = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "ignore_eos": True})

    def crash(ids: list[str]) -> None:
        time.sleep(0.02)  # slow steps: the stream is still running when the second request comes
        if len(ids) >= 2:  # both requests are in the engine
            raise RuntimeError("injected: a bug inside the step")

    engine.engine.fault_hook = crash
    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    threads[0].start()
    assert streaming.wait(20)
    start = time.monotonic()
    threads[1].start()
    for t in threads:
        t.join(10)
    assert time.monotonic() - start < 10 and not any(t.is_alive() for t in threads)
    plain_r = results["plain"]
    assert plain_r.status_code == 500 and plain_r.json()["error"]["code"] == "EngineDeadError"
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "EngineDeadError"
    assert engine.errored
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"

    async def direct() -> None:
        async for _ in engine.generate("hi", SamplingParams(max_tokens=1), "late"):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(direct(), 5))


# --- the process ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float) -> list[str]:
    """The error codes /health gave before its 200."""
    deadline = time.monotonic() + timeout
    codes: list[str] = []
    while True:
        assert proc.poll() is None, f"exited early:\n{log.read_text()[-3000:]}"
        try:
            r = httpx.get(f"{base}/health", timeout=2)
            if r.status_code == 200:
                return codes
            assert r.status_code == 503, r.text
            codes.append(r.json()["error"]["code"])
            refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, timeout=2)
            assert refused.status_code == 503 or refused.status_code == 200
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"no /health after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_jaxserve_serve_sigterm_during_streaming_aborts_and_exits_0_in_seconds(model_dir, tmp_path) -> None:
    """/health is 503 while the engine warms up; with the default --shutdown-timeout 0, as vLLM,
    SIGTERM ends a stream at once with finish_reason "abort" and the process exits 0 in seconds."""
    port = _free_port()
    log_path = tmp_path / "serve.log"
    exe = Path(sys.executable).with_name("jaxserve")
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={json.dumps(v) if isinstance(v, dict) else v}"
             for k, v in TINY.items()]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                                 *flags], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        assert "starting_up" in _wait_healthy(proc, base, log_path, 240)  # bound while it warmed up
        with httpx.stream("POST", f"{base}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]
        chunks = [json.loads(x[len("data: "):]) for x in rest if x.startswith("data: {")]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=15) == 0, log_path.read_text()[-3000:]
        assert time.monotonic() - start < 8, time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
