"""The OpenAI server on the REAL engine and the default model (SmolLM2-135M-Instruct), over real HTTP.

One uvicorn server on 127.0.0.1 (a free port) for the session (tests/conftest.py `served`), serving an AsyncLLM built on the
session's loaded weights, driven by the official `openai` client (sync and async, streaming and
not, completions and chat) and by httpx. Greedy references come from the offline API on the very
same engine, run before it is handed to AsyncLLM, so no second warm-up is paid. The last test
starts `jaxserve serve` as a subprocess, the way a user does.

Buckets are kept few (max_num_batched_tokens=64 with chunked prefill: token buckets 16/32/64,
sequence buckets 8/16) so the warm-up stays short on a 2-core CPU.
"""

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
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.worker.sizing import cpu_has_bf16_dots
from tests.conftest import (CHAT_TOKENS, CHATS, ENGINE, GREEDY_PROMPTS, GREEDY_TOKENS, MAX_MODEL_LEN, MODEL, PROMPTS,
                            Served)

pytestmark = [pytest.mark.slow, pytest.mark.warmup]  # warmup: its engines hold 0 compilations after warm-up

@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def aclient(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)


def scrape(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client: each sample name's value summed over its labels (one model;
    do not read `_bucket` samples from this)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        if (idle and m["vllm:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# --- the official client, sync and async, streaming and not --------------------------------------


def test_models_and_health(served: Served, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_completions_greedy_equal_offline(client: openai.OpenAI, served: Served) -> None:
    for prompt in GREEDY_PROMPTS[:2]:
        offline = served.completions[prompt]
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0)
        choice = resp.choices[0]
        assert choice.text == offline.outputs[0].text, prompt
        assert choice.finish_reason == offline.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
        assert resp.usage.completion_tokens == len(offline.outputs[0].token_ids)
    # Several prompts in one request, each its own choice, the same greedy text.
    resp = client.completions.create(model=MODEL, prompt=GREEDY_PROMPTS, max_tokens=GREEDY_TOKENS, temperature=0)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [
        served.completions[p].outputs[0].text for p in GREEDY_PROMPTS]


def test_completions_streaming_sync(client: openai.OpenAI, served: Served) -> None:
    prompt = GREEDY_PROMPTS[0]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == served.completions[prompt].outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == GREEDY_TOKENS


def test_chat_greedy_equal_offline_through_the_template(client: openai.OpenAI, served: Served) -> None:
    for messages, offline in zip(CHATS, served.chats):
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=CHAT_TOKENS,
                                              temperature=0)
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == offline.outputs[0].text
        assert resp.choices[0].finish_reason == offline.outputs[0].finish_reason
        # The HTTP layer renders the template to text and tokenizes it; the offline API tokenizes in
        # apply_chat_template: the same prompt ids either way.
        assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
        assert resp.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert "<|im_start|>assistant" in served.engine.tokenizer.decode(served.chats[0].prompt_token_ids)


def test_chat_streaming_sync(client: openai.OpenAI, served: Served) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=CHAT_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == served.chats[0].outputs[0].text
    assert chunks[-1].choices[0].finish_reason == served.chats[0].outputs[0].finish_reason


def test_async_client_streaming_and_not(served: Served) -> None:
    prompt = GREEDY_PROMPTS[1]

    async def plain(c: openai.AsyncOpenAI) -> str:
        resp = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0)
        return resp.choices[0].text

    async def streamed(c: openai.AsyncOpenAI) -> str:
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                                            stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def chat(c: openai.AsyncOpenAI) -> str:
        resp = await c.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=CHAT_TOKENS, temperature=0)
        return resp.choices[0].message.content or ""

    async def chat_streamed(c: openai.AsyncOpenAI) -> str:
        stream = await c.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=CHAT_TOKENS,
                                                 temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream])

    async def run() -> list[str]:
        async with aclient(served) as c:  # all four at once: one batch, and greedy is batch-independent
            return await asyncio.gather(plain(c), streamed(c), chat(c), chat_streamed(c))

    plain_text, streamed_text, chat_text, chat_streamed_text = asyncio.run(run())
    assert plain_text == streamed_text == served.completions[prompt].outputs[0].text
    assert chat_text == chat_streamed_text == served.chats[1].outputs[0].text


def test_seeded_sampling_is_reproducible_over_http(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0.9, top_p=0.9, seed=42,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first


# --- load, disconnects, bad input ----------------------------------------------------------------


def test_64_concurrent_streaming_clients(served: Served) -> None:
    num_tokens = 8

    async def one(c: openai.AsyncOpenAI, k: int) -> tuple[int, str | None, int]:
        if k % 2:
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {k}."}], max_tokens=num_tokens,
                temperature=0.8, seed=k, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
        else:
            stream = await c.completions.create(
                model=MODEL, prompt=f"{PROMPTS[k % len(PROMPTS)]} {k}", max_tokens=num_tokens, temperature=0.8,
                seed=k, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, usage = None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return k, finish, usage

    async def run() -> list[tuple[int, str | None, int]]:
        async with aclient(served) as c:
            return await asyncio.gather(*(one(c, k) for k in range(64)))

    start = scrape(served.url)
    results = asyncio.run(run())
    assert sorted(k for k, _, _ in results) == list(range(64))
    assert all(finish == "length" and usage == num_tokens for _, finish, usage in results), results
    after = wait_idle(served.url)
    assert after["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"] == 64 * num_tokens
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:num_requests_running"] == 0


def test_client_disconnect_mid_stream_frees_the_request(served: Served) -> None:
    before = wait_idle(served.url)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=served.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
            running = scrape(served.url)
            assert running["vllm:num_requests_running"] == 1 and running["vllm:kv_cache_usage_perc"] > 0
        # leaving the block closes the half-read response: the connection drops
    after = wait_idle(served.url, timeout=10)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:gpu_cache_usage_perc"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 3 <= generated < 200, "the request was not aborted"
    assert not served.engine.engine.has_unfinished_requests()


def _error(exc: openai.APIStatusError) -> dict[str, object]:
    body = exc.response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def test_bad_input_is_a_400_and_the_server_keeps_serving(client: openai.OpenAI, served: Served) -> None:
    long_ids = served.engine.tokenizer.encode("hello " * 400)
    assert len(long_ids) > MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 400, max_tokens=4)
    err = _error(info.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert str(MAX_MODEL_LEN) in str(err["message"])
    with pytest.raises(openai.BadRequestError) as info:  # token ids, streaming: still a 400, not a 200 stream
        client.completions.create(model=MODEL, prompt=list(range(100, 100 + MAX_MODEL_LEN)), max_tokens=1,
                                  stream=True)
    assert _error(info.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:  # max_tokens beyond the context
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_MODEL_LEN)
    err = _error(info.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHATS[0], max_completion_tokens=10 * MAX_MODEL_LEN)
    assert _error(info.value)["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 400}],
                                       max_tokens=4)
    assert _error(info.value)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:  # the sampler would silently drop an unknown id
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, logit_bias={"100000": 5})
    assert _error(info.value)["param"] == "logit_bias"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt=PROMPTS[0], max_tokens=4)
    assert _error(info.value)["code"] == "model_not_found"
    # The longest prompt that fits (chunked over 4 prefill steps) plus one token still works.
    edge = client.completions.create(model=MODEL, prompt=long_ids[:MAX_MODEL_LEN - 1], max_tokens=1, temperature=0)
    assert edge.usage.completion_tokens == 1 and edge.usage.prompt_tokens == MAX_MODEL_LEN - 1
    good = client.completions.create(model=MODEL, prompt=GREEDY_PROMPTS[0], max_tokens=GREEDY_TOKENS, temperature=0)
    assert good.choices[0].text == served.completions[GREEDY_PROMPTS[0]].outputs[0].text
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert not served.engine.errored


def test_metrics_parse_and_nothing_compiled_while_serving(served: Served) -> None:
    """Runs after all the traffic above (pytest keeps file order)."""
    m = wait_idle(served.url)
    stats = served.engine.get_stats()
    assert m["jaxserve:xla_compilations_total"] == stats.num_compilations > 0
    assert m["jaxserve:xla_compilations_after_warmup_total"] == 0
    assert stats.num_compilations_after_warmup == 0, "serving compiled a new XLA program"
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:generation_tokens_total"] > 64 * 8
    assert m["vllm:request_success_total"] > 64
    assert m["vllm:time_to_first_token_seconds_count"] > 64
    assert m["vllm:e2e_request_latency_seconds_count"] > 64
    assert m["jaxserve:num_gpu_blocks"] == ENGINE["num_gpu_blocks_override"]
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    assert served.engine.engine.scheduler.kv.num_free_blocks == served.engine.engine.num_gpu_blocks


# --- `jaxserve serve` as a user runs it ----------------------------------------------------------

# One token bucket and one sequence bucket: the warm-up is short, the start-up path is the same.
SERVE_FLAGS = ["--max-model-len", "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "16",
               "--enable-chunked-prefill", "--num-gpu-blocks-override", "16"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jaxserve_serve_cli_starts_answers_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    """`jaxserve serve` from the command line: the default model, /health, the README's curl request,
    a chat request, the start-up report, and SIGTERM finishing an in-flight request, then exit 0."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    exe = Path(sys.executable).with_name("jaxserve")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), *SERVE_FLAGS,
                                 "--shutdown-timeout", "60"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"jaxserve serve exited early:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no /health after 240 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        # The README's curl example, as JSON.
        readme = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        resp = httpx.post(f"{base}/v1/completions", json=readme, timeout=60)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "text_completion" and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["text"]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        log = log_path.read_text()
        assert re.search(r"\d+ KV blocks of 64 tokens", log), log  # no --block-size: the CPU's default
        assert ("CPU defaults for flags not given: --block-size 64 --kv-cache-dtype bfloat16 --speculative-config "
                """'{"method": "ngram", "num_speculative_tokens": 4}'""") in log, log
        # how to get the exact float32 setting
        assert "--block-size 16 --kv-cache-dtype auto --speculative-config '{}' --dtype float32" in log, log
        if cpu_has_bf16_dots():  # the CPU's bfloat16 dots, where it has the instructions
            assert "--dtype auto (float32 weights, bfloat16 dots in steps of 64+ tokens)" in log, log
        assert re.search(r"max concurrency [\d.]+ requests at max_model_len", log), log
        assert re.search(r"warm-up compiled in [\d.]+s", log), log
        # SIGTERM while a request is in flight: it still completes, then the process exits 0.
        result: dict[str, httpx.Response] = {}
        inflight = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            f"{base}/v1/completions", timeout=60,
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True})))
        inflight.start()
        deadline = time.monotonic() + 30
        while scrape(base)["vllm:num_requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        inflight.join(60)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 32
        assert proc.wait(60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
