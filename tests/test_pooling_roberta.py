"""XLM-RoBERTa pooling models (bge-m3's and bge-reranker-v2-m3's shape): a tiny random XLMRobertaModel
saved as a sentence-transformers model (CLS pooling, normalize) and a tiny random
XLMRobertaForSequenceClassification CrossEncoder (classifier: dense + tanh + out_proj), against
sentence-transformers. Their tokenizer is a tiny Unigram model trained here with `tokenizers` and
wrapped as XLMRobertaTokenizerFast (XLM-R's special tokens and pair template; nothing downloaded).
Positions start at padding_idx + 1, so the longest text reaches the last position."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import numpy as np
import pytest

import torch
import transformers
import sentence_transformers as st
from sentence_transformers.sentence_transformer import modules as st_models

from jaxserve import LLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.pooling.config import read_pooling_info
from jaxserve.engine.async_llm import AsyncLLM
from tests.fake_engine import serve_in_thread

WORDS = ("the quick brown fox jumps over lazy dog Paris capital France Berlin Germany bananas yellow river "
         "Seine tower tax law what is in of a city crème brûlée café naïve über straße 日本語 テキスト").split()
TEXTS = ["", "hello world", "Crème brûlée 🤗", "the quick brown fox jumps over the lazy dog", "a b c",
         "What is the capital of France?", "Paris is the capital of France.", "Berlin is in Germany.",
         " ".join(WORDS[i % 12] for i in range(13))]  # the longest: 61 of the 64 positions
QUERY = "what is the capital of France"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris, on the Seine.",
        "The Eiffel tower", "tax law in 1990", ""]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, compilation_cache_dir="", progress=False)


@pytest.fixture(scope="module")
def xlmr_tokenizer() -> "transformers.XLMRobertaTokenizerFast":
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12))) for _ in range(300)]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(sentences, trainers.UnigramTrainer(
        vocab_size=120, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(  # XLM-R's: <s> A </s> and <s> A </s></s> B </s>
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return transformers.XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                                sep_token="</s>", cls_token="<s>")


def _config(tok, **kwargs) -> "transformers.XLMRobertaConfig":
    return transformers.XLMRobertaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=66,
                                         pad_token_id=1, type_vocab_size=1, **kwargs)


def _spread(model, skip: str = "LayerNorm") -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # larger than the default init, so outputs are far from uniform
        for name, p in model.named_parameters():
            if skip not in name:
                p.mul_(4.0)


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory, xlmr_tokenizer) -> str:
    raw, out = tmp_path_factory.mktemp("xlmr_hf"), tmp_path_factory.mktemp("xlmr_st")
    torch.manual_seed(0)
    model = transformers.XLMRobertaModel(_config(xlmr_tokenizer)).float().eval()
    _spread(model)
    model.save_pretrained(raw)
    xlmr_tokenizer.save_pretrained(raw)
    module = st_models.Transformer(str(raw), max_seq_length=64)
    pooling = st_models.Pooling(module.get_embedding_dimension(), pooling_mode="cls")  # bge-m3's dense pooler
    st.SentenceTransformer(modules=[module, pooling, st_models.Normalize()], device="cpu").save(str(out))
    return str(out)


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory, xlmr_tokenizer) -> str:
    raw, out = tmp_path_factory.mktemp("xlmr_ce_hf"), tmp_path_factory.mktemp("xlmr_ce_st")
    torch.manual_seed(0)
    model = transformers.XLMRobertaForSequenceClassification(_config(xlmr_tokenizer, num_labels=1)).float().eval()
    _spread(model)
    with torch.no_grad():  # spread the relevance scores around 0.5, so their order is a real check
        model.classifier.out_proj.weight.mul_(300.0)
        pairs = xlmr_tokenizer([QUERY] * len(DOCS), DOCS, padding=True, truncation=True, max_length=64,
                               return_tensors="pt")
        logits = model(**pairs).logits
        model.classifier.out_proj.bias.sub_(logits.mean())
    model.save_pretrained(raw)
    xlmr_tokenizer.save_pretrained(raw)
    st.CrossEncoder(str(raw), device="cpu", max_length=64).save_pretrained(str(out))
    return str(out)


def test_xlm_roberta_sentence_transformers_embedder(embedder_dir: str, xlmr_tokenizer) -> None:
    info = read_pooling_info(Path(embedder_dir))
    assert (info.runner, info.task, info.pooler.pooling_type, info.pooler.normalize) == ("pooling", "embed", "CLS", True)
    assert max(len(xlmr_tokenizer(t)["input_ids"]) for t in TEXTS) == 61  # the last positions are used
    ref = st.SentenceTransformer(embedder_dir, device="cpu").encode(TEXTS, batch_size=32, convert_to_numpy=True)
    llm = LLM(embedder_dir, **ENGINE)  # runner auto: pooling
    assert llm.llm_engine.max_model_len == 64  # max_position_embeddings - (padding_idx + 1)
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)  # float32 against sentence-transformers' float32
    assert np.abs(ref @ ref.T - np.eye(len(TEXTS))).max() > 0.05  # the embeddings differ from each other
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.embed([list(range(5, 70))])


def test_xlm_roberta_cross_encoder(reranker_dir: str) -> None:
    ref = st.CrossEncoder(reranker_dir, device="cpu").predict([(QUERY, d) for d in DOCS])
    assert np.ptp(ref) > 0.05  # distinct scores, so the order below means something
    llm = LLM(reranker_dir, runner="pooling", **ENGINE)
    assert llm.llm_engine.pooling_info.task == "classify" and llm.llm_engine.model.config.family == "roberta"
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCS)])
    assert np.abs(got - ref).max() < 1e-4, (got, ref)
    engine = AsyncLLM(llm.llm_engine)
    try:
        with serve_in_thread(build_app(engine)) as url:
            body = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60).json()
            assert [r["index"] for r in body["results"]] == [int(i) for i in np.argsort(-ref, kind="stable")]
            assert max(abs(r["relevance_score"] - ref[r["index"]]) for r in body["results"]) < 1e-4
    finally:
        engine.shutdown()
