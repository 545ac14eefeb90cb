"""`LLM(model, runner="pooling")`'s embed / classify / score (vLLM's offline pooling API)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.pooling import io
from jaxserve.pooling.engine import PoolingEngine
from jaxserve.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                      EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput)

Prompts = str | list[int] | Sequence[str] | Sequence[list[int]]


def _tokenize(engine: PoolingEngine, prompts: Prompts, truncate: int | None) -> list[io.TokenizedInput]:
    inputs = io.as_inputs(prompts if not isinstance(prompts, tuple) else list(prompts), "prompts")
    tokenized = io.tokenize(engine.tokenizer, inputs, truncate, engine.max_model_len, len(engine.tokenizer))
    for ids, _ in tokenized:
        engine.check_length(ids, "prompts")
    return tokenized


def embed(engine: PoolingEngine, prompts: Prompts, truncate_prompt_tokens: int | None = None,
          dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
    if engine.task != "embed":
        raise ValueError("runner: embed needs an embedding model; this one classifies (pass convert='embed')")
    io.check_dimensions(engine.info, dimensions, engine.model.cfg.hidden_size)
    tokenized = _tokenize(engine, prompts, truncate_prompt_tokens)
    rows = engine.run_to_completion(tokenized)
    return [EmbeddingRequestOutput(str(i), EmbeddingOutput(io.embedding(r, dimensions, engine.info.pooler.normalize)
                                                           .tolist()), ids)
            for i, ((ids, _), r) in enumerate(zip(tokenized, rows))]


def classify(engine: PoolingEngine, prompts: Prompts,
             truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
    if engine.task != "classify":
        raise ValueError("runner: classify needs a classification model (a *ForSequenceClassification)")
    tokenized = _tokenize(engine, prompts, truncate_prompt_tokens)
    rows = engine.run_to_completion(tokenized)
    act = engine.info.pooler.activation
    return [ClassificationRequestOutput(str(i), ClassificationOutput(io.probabilities(r, act).tolist()), ids)
            for i, ((ids, _), r) in enumerate(zip(tokenized, rows))]


def score(engine: PoolingEngine, text_1: str | Sequence[str], text_2: str | Sequence[str],
          truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
    """Cross-encoder: one score per (text_1, text_2) pair; embedding model: their cosine similarity."""
    firsts, seconds = io.pair_lists(text_1, text_2)
    if engine.task == "classify":
        if engine.num_labels != 1:
            raise ValueError(f"runner: score needs a cross-encoder with one label; this model has {engine.num_labels}")
        tokenized = io.tokenize_pairs(engine.tokenizer, firsts, seconds,
                                      truncate_prompt_tokens or engine.max_model_len)
        rows = engine.run_to_completion(tokenized)
        act = engine.info.score_activation and engine.info.pooler.activation
        return [ScoringRequestOutput(str(i), ScoringOutput(float(io.probabilities(r, act)[0])), ids)
                for i, ((ids, _), r) in enumerate(zip(tokenized, rows))]
    a = embed(engine, firsts, truncate_prompt_tokens)
    b = embed(engine, seconds, truncate_prompt_tokens)
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        u, v = np.asarray(x.outputs.embedding), np.asarray(y.outputs.embedding)
        cos = float(u @ v / max(np.linalg.norm(u) * np.linalg.norm(v), 1e-12))
        out.append(ScoringRequestOutput(str(i), ScoringOutput(cos), x.prompt_token_ids + y.prompt_token_ids))
    return out
