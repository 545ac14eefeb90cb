"""vLLM's pooling output classes: `LLM.embed` / `.classify` / `.score` return these."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PoolingOutput:
    data: np.ndarray  # [D] f32: the embedding, or the class probabilities


@dataclass
class PoolingRequestOutput:
    """One pooling request's result (LLMEngine.step / AsyncLLM.encode), as vLLM's."""
    request_id: str
    outputs: PoolingOutput | None  # None when aborted
    prompt_token_ids: list[int]
    finished: bool = True
    aborted: bool = False  # ended before its step (abort, shutdown): no result


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
