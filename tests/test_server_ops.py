"""What an operator relies on, on the fake engine (tests/fake_engine.py) over real HTTP: load shedding
(--max-num-queued-reqs), draining on SIGTERM (--shutdown-timeout), authentication that no path trick
bypasses, and error bodies that leak nothing. The real engine's faults: tests/test_server_faults.py."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.entrypoints.openai.api_server import build_app
from tests.fake_engine import FakeAsyncLLM, serve_in_thread

ROOT = Path(__file__).resolve().parent.parent


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_max_num_queued_reqs_sheds_load_at_once() -> None:
    """Two requests wait (the fake engine's first step takes 1 s); a third gets a 503 at once, then
    the two finish normally and the server takes requests again."""
    engine = FakeAsyncLLM(step_delay=1.0)
    with serve_in_thread(build_app(engine, max_num_queued_reqs=2)) as base, httpx.Client(base_url=base) as http:
        results: list[httpx.Response] = []
        body = {"prompt": "w1", "max_tokens": 1}
        threads = [threading.Thread(target=lambda: results.append(http.post("/v1/completions", json=body,
                                                                          timeout=30))) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while engine.num_queued() < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        shed = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]})
        assert time.monotonic() - start < 0.5
        assert shed.status_code == 503 and _error(shed)["code"] == "server_overloaded"
        assert http.post("/v1/completions", json={**body, "stream": True}).status_code == 503
        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]
        assert http.post("/v1/completions", json=body, timeout=30).json()["choices"][0]["text"] == "w2"


def test_request_limits_are_400s_before_any_work() -> None:
    engine = FakeAsyncLLM()
    app = build_app(engine, max_n_sequences=8, max_header_bytes=4096)
    chat = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 1}
    cases = [("/v1/completions", {"prompt": "w1", "n": 9}, "n"),
             ("/v1/completions", {"prompt": "w1", "n": 2, "best_of": 9}, "best_of"),
             ("/v1/chat/completions", {**chat, "n": 9}, "n"),
             ("/v1/completions", {"prompt": "w1", "max_tokens": -1}, "max_tokens"),
             ("/v1/chat/completions", {**chat, "max_tokens": -1}, "max_completion_tokens"),
             ("/v1/completions", {"prompt": "w1", "logprobs": 21}, "logprobs"),
             ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ("/v1/completions", {"prompt": ""}, "prompt"),
             ("/v1/completions", {"prompt": [[]]}, "prompt"),
             ("/v1/completions", {"prompt": [128]}, "prompt"),
             ("/v1/completions", {"prompt": [-1]}, "prompt"),
             ("/v1/completions", {"prompt": "w1 " * 64}, "prompt"),
             ("/v1/completions", {"prompt": "w1", "max_tokens": 64}, "max_tokens"),
             ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
              "chat_template_kwargs"),
             ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")]
    with serve_in_thread(app) as base, httpx.Client(base_url=base) as http:
        for path, body, param in cases:
            r = http.post(path, json=body)
            assert r.status_code == 400 and _error(r)["param"] == param, (body, r.text)
            assert "transformers" not in r.text
        big = http.get("/v1/models", headers={f"x-h{i}": "a" * 100 for i in range(50)})
        assert big.status_code == 431 and _error(big)["code"] == "request_header_fields_too_large"
        ok = http.post("/v1/chat/completions", json={**chat, "n": 8, "chat_template_kwargs": {"x": 1}})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
    assert not engine.running and len(engine.finished) == 1  # nothing but the good request reached it


# --- shutdown --------------------------------------------------------------------------------------

_SERVE_SCRIPT = """
import sys
from jaxserve.entrypoints.cli_args import ServerArgs
from jaxserve.entrypoints.openai.api_server import build_app, serve_app
from tests.fake_engine import FakeAsyncLLM

class Dying(FakeAsyncLLM):  # a request for "w101" crashes the fake engine for good
    errored = False

    async def generate(self, prompt, *args, **kwargs):
        if self.crash_id in prompt:
            self.errored = True
            raise RuntimeError("the fake engine died")
        async for out in super().generate(prompt, *args, **kwargs):
            yield out

sys.exit(serve_app(build_app(Dying(step_delay=0.1)),
                   ServerArgs(host="127.0.0.1", port=int(sys.argv[1]), shutdown_timeout=float(sys.argv[2]),
                              uvicorn_log_level="warning")))
"""


def _start_fake_server(shutdown_timeout: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_SCRIPT, str(port), str(shutdown_timeout)], cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
        time.sleep(0.1)


def _finish_reasons(lines: list[str]) -> list[str]:
    chunks = [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: {")]
    return [c["finish_reason"] for chunk in chunks for c in chunk.get("choices", []) if c["finish_reason"]]


@pytest.mark.parametrize("shutdown_timeout", [0.0, 1.5])
def test_sigterm_drains_then_aborts_and_exits_0(shutdown_timeout: float) -> None:
    """SIGTERM during a long stream (60 tokens at 10 a second): new requests and /health get 503
    while it drains; after `shutdown_timeout` the stream ends with finish_reason "abort" and the
    process exits 0, in seconds, not the stream's 6 s."""
    proc, base = _start_fake_server(shutdown_timeout)
    try:
        body = {"prompt": "w1", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=base, timeout=10) as http, http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            if shutdown_timeout:
                time.sleep(0.3)
                refused = httpx.post(f"{base}/v1/completions", json={"prompt": "w1", "max_tokens": 1})
                assert refused.status_code == 503 and _error(refused)["code"] == "shutting_down"
                assert httpx.get(f"{base}/health").status_code == 503
            rest = list(lines)
        ended = time.monotonic() - start
        assert [x for x in rest if x][-1] == "data: [DONE]"
        assert _finish_reasons(rest) == ["abort"]
        assert shutdown_timeout <= ended < shutdown_timeout + 2.0, ended
        assert proc.wait(timeout=8) == 0
        assert time.monotonic() - start < shutdown_timeout + 6.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_dead_engine_exits_the_server_non_zero() -> None:
    """A dead engine: the server exits 1 in seconds; what else still runs (a data-parallel replica's
    requests) ends with finish_reason "abort" instead of being cut off."""
    proc, base = _start_fake_server(30.0)
    try:
        body = {"prompt": "w1", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=base, timeout=10) as http, http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            crash = httpx.post(f"{base}/v1/completions", json={"prompt": "w101", "max_tokens": 4})
            assert crash.status_code == 500
            start = time.monotonic()
            rest = list(lines)
        assert _finish_reasons(rest) == ["abort"] and time.monotonic() - start < 3
        assert proc.wait(timeout=10) == 1
        assert time.monotonic() - start < 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --- authentication and what errors show ----------------------------------------------------------


@pytest.mark.parametrize("protect_metrics", [False, True])
def test_api_key_on_every_route_but_health(protect_metrics: bool) -> None:
    app = build_app(FakeAsyncLLM(), api_key="sekret", protect_metrics=protect_metrics)
    with serve_in_thread(app) as base, httpx.Client(base_url=base) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == (401 if protect_metrics else 200)
        key = {"Authorization": "Bearer sekret"}
        assert http.get("/metrics", headers=key).status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", "//v1/models"), ("GET", "/v1/../v1/models"),
                             ("GET", "/v1/%6dodels"), ("GET", "/v1/models/"), ("GET", "/V1/models"),
                             ("GET", "/version"), ("GET", "/openapi.json"), ("POST", "/tokenize"),
                             ("POST", "/detokenize"), ("POST", "/v1/completions"), ("GET", "/health/"),
                             ("GET", "//health"), ("GET", "/nothing")]:
            for headers in ({}, {"Host": "localhost"}, {"Authorization": "Bearer sekre"},
                            {"Authorization": "bearer sekret"}, {"Authorization": "Bearer  sekret"}, {"Authorization": "sekret"}):
                r = http.request(method, path, headers=headers, json={"prompt": "w1"})
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert _error(r)["code"] == "invalid_api_key"
        ok = http.post("/v1/completions", headers=key, json={"prompt": "w1", "max_tokens": 1})
        assert ok.json()["choices"][0]["text"] == "w2"


def test_internal_errors_carry_no_paths_or_tracebacks() -> None:
    class Broken(FakeAsyncLLM):
        async def generate(self, *args, **kwargs):
            raise OSError(2, "No such file", "/secret/path/model.bin")
            yield  # an async generator

    with serve_in_thread(build_app(Broken())) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "w1", "max_tokens": 1})
        assert r.status_code == 500
        error = _error(r)
        assert error["type"] == "server_error"
        assert "/secret" not in r.text and "Traceback" not in r.text and "File " not in r.text
        assert httpx.get(f"{base}/health").status_code == 200


def test_nan_and_infinity_in_float_fields_are_a_400() -> None:
    """NaN/Infinity (JSON's non-standard literals) in every float field: a 400 naming it."""
    floats = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty",
              "length_penalty"]
    with serve_in_thread(build_app(FakeAsyncLLM())) as base, httpx.Client(base_url=base) as http:
        for name in floats:
            for literal in ("NaN", "Infinity", "-Infinity"):
                content = '{"prompt": "w1", "max_tokens": 1, "%s": %s}' % (name, literal)
                r = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
                assert r.status_code == 400, (name, literal, r.text)
                assert _error(r)["param"] == name, (name, r.text)
        bias = '{"prompt": "w1", "max_tokens": 1, "logit_bias": {"5": NaN}}'
        r = http.post("/v1/completions", content=bias, headers={"content-type": "application/json"})
        assert r.status_code == 400 and _error(r)["param"].startswith("logit_bias")


# --- fuzzing from /openapi.json --------------------------------------------------------------------

_ROUTES = [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
           ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]


def _values(schema: dict, defs: dict, depth: int = 0):
    """A hypothesis strategy of JSON values of `schema`'s types (not every constraint: out-of-range
    numbers and strings are the point), following $ref, anyOf and object properties."""
    from hypothesis import strategies as st

    if "$ref" in schema:
        return _values(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return st.one_of([_values(o, defs, depth) for o in options])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema.get("const")])
    kind = schema.get("type")
    if depth > 3 or kind == "null":
        return st.none()
    if kind == "object" and "properties" in schema:
        props = {k: _values(v, defs, depth + 1) for k, v in schema["properties"].items()}
        required = {k: props.pop(k) for k in schema.get("required", []) if k in props}
        return st.fixed_dictionaries(required, optional=props)
    simple = {"string": st.text(max_size=12) | st.sampled_from(["w1", "w10 w11", "hello world", ""]),
              "integer": st.integers(-3, 80) | st.integers(), "boolean": st.booleans(),
              "number": st.floats(-3, 3, allow_nan=False) | st.floats(allow_nan=False, allow_infinity=False)}
    if kind in simple:
        return simple[kind]
    if kind == "array":
        return st.lists(_values(schema.get("items", {}), defs, depth + 1), max_size=3)
    return st.none() | st.integers(-2, 5) | st.text(max_size=5) | st.lists(st.integers(0, 130), max_size=3)


def _request_schema(spec: dict, name: str) -> tuple[dict, dict]:
    defs = spec["components"]["schemas"]
    return defs[name], defs


@pytest.fixture(scope="module")
def fuzz_target():
    engine = FakeAsyncLLM(crash_token=None)
    with serve_in_thread(build_app(engine, max_n_sequences=4)) as base, httpx.Client(base_url=base, timeout=10) as http:
        spec = http.get("/openapi.json").json()
        yield http, engine, {path: _request_schema(spec, name) for path, name in _ROUTES}


def test_fuzz_schema_bodies_never_5xx_then_a_normal_request_is_right(fuzz_target) -> None:
    """Bodies drawn from each route's own schema (so they reach the checks past parsing), some with a
    float turned into NaN/Infinity: never a 5xx, errors OpenAI-shaped; then a normal request."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    http, engine, schemas = fuzz_target
    literal = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"])

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(sorted(schemas)))
        body = data.draw(_values(*schemas[path]))
        content = json.dumps(body)
        if isinstance(body, dict) and body and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(body)))
            content = json.dumps({**body, key: "@@"}).replace('"@@"', data.draw(literal))
        r = http.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code < 500, (path, content, r.text)
        if r.status_code >= 400:
            _error(r)

    check()
    r = http.post("/v1/completions", json={"prompt": "w10", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "w11 w12 w13"
    assert not engine.running


def test_operator_flags_parse_and_validate() -> None:
    import argparse

    from jaxserve.entrypoints.cli_args import ServerArgs, add_serve_args, resolve

    parser = add_serve_args(argparse.ArgumentParser(), positional_model=True)
    config = resolve(parser.parse_args(["--shutdown-timeout", "5", "--max-num-queued-reqs", "3",
                                        "--max-n-sequences", "8", "--api-key-protects-metrics",
                                        "--max-request-header-bytes", "4096"]))
    server = config.server
    assert (server.shutdown_timeout, server.max_num_queued_reqs, server.max_n_sequences) == (5.0, 3, 8)
    assert server.api_key_protects_metrics and server.max_request_header_bytes == 4096
    assert ServerArgs().shutdown_timeout == 0 and ServerArgs().max_num_queued_reqs is None
    for bad in ({"shutdown_timeout": -1.0}, {"shutdown_timeout": float("nan")}, {"max_num_queued_reqs": -1},
                {"max_n_sequences": 0}, {"max_request_header_bytes": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerArgs(**bad)
