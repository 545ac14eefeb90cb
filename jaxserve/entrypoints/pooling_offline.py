"""`LLM(model, runner="pooling")`'s embed / classify / score (vLLM's offline pooling API), over the one
LLMEngine: every input is one pooling request, stepped to completion in the caller's thread."""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.pooling import io
from jaxserve.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                      EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput)

Prompts = str | list[int] | Sequence[str] | Sequence[list[int]]
_ids = itertools.count()


def task(engine: LLMEngine) -> str:
    return engine.pooling_info.task or "embed"


def num_labels(engine: LLMEngine) -> int:
    return getattr(engine.model.config, "num_labels", 0)


def _tokenize(engine: LLMEngine, prompts: Prompts, truncate: int | None) -> list[io.TokenizedInput]:
    inputs = io.as_inputs(prompts if not isinstance(prompts, tuple) else list(prompts), "prompts")
    tokenized = io.tokenize(engine.tokenizer, inputs, truncate, engine.max_model_len, len(engine.tokenizer),
                            do_lower_case=engine.pooling_info.do_lower_case)
    for ids, _ in tokenized:
        engine.check_pooling_input(ids, "prompts")
    return tokenized


def run_to_completion(engine: LLMEngine, inputs: list[io.TokenizedInput]) -> list[np.ndarray]:
    """Each input's result row (embedding post-processed, or logits), in order."""
    ids = [f"offline-pool-{next(_ids)}" for _ in inputs]
    for rid, (tokens, types) in zip(ids, inputs):
        engine.add_pooling_request(rid, tokens, types)
    rows: dict[str, np.ndarray] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in rows or not hasattr(out, "aborted"):
                continue
            rows[out.request_id] = out.outputs.data
    return [rows[r] for r in ids]


def embed(engine: LLMEngine, prompts: Prompts, truncate_prompt_tokens: int | None = None,
          dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
    if task(engine) != "embed":
        raise ValueError("runner: embed needs an embedding model; this one classifies (pass convert='embed')")
    io.check_dimensions(engine.pooling_info, dimensions, engine.pooler.dimension(engine.model.config.hidden_size))
    tokenized = _tokenize(engine, prompts, truncate_prompt_tokens)
    rows = run_to_completion(engine, tokenized)
    return [EmbeddingRequestOutput(str(i), EmbeddingOutput(io.embedding(r, dimensions, engine.pooling_info.pooler.normalize).tolist()), ids)
            for i, ((ids, _), r) in enumerate(zip(tokenized, rows))]


def classify(engine: LLMEngine, prompts: Prompts,
             truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
    if task(engine) != "classify":
        raise ValueError("runner: classify needs a classification model (a *ForSequenceClassification)")
    tokenized = _tokenize(engine, prompts, truncate_prompt_tokens)
    rows = run_to_completion(engine, tokenized)
    act = engine.pooling_info.pooler.activation
    return [ClassificationRequestOutput(str(i), ClassificationOutput(io.probabilities(r, act).tolist()), ids)
            for i, ((ids, _), r) in enumerate(zip(tokenized, rows))]


def score(engine: LLMEngine, text_1: str | Sequence[str], text_2: str | Sequence[str],
          truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
    """Cross-encoder: one score per (text_1, text_2) pair; embedding model: their cosine similarity."""
    firsts, seconds = io.pair_lists(text_1, text_2)
    if task(engine) == "classify":
        if num_labels(engine) != 1:
            raise ValueError(f"runner: score needs a cross-encoder with one label; this model has "
                             f"{num_labels(engine)}")
        tokenized = io.tokenize_pairs(engine.tokenizer, firsts, seconds,
                                      truncate_prompt_tokens or engine.max_model_len, engine.pooling_info.do_lower_case)
        rows = run_to_completion(engine, tokenized)
        info = engine.pooling_info
        act = info.score_activation and info.pooler.activation
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
