"""What the HTTP routes and the offline API share: inputs to token ids, raw rows to results.

No JAX here: it runs on the caller's thread (the event loop hands it to a worker thread), off the
engine's step.
"""

from __future__ import annotations

import base64

import numpy as np

from jaxserve.pooling.config import PoolingModelInfo

TokenizedInput = tuple[list[int], list[int] | None]  # token ids, segment ids (pairs) or None


def as_inputs(value: object, field: str = "input") -> list[str] | list[list[int]]:
    """A string, a list of strings, a token-id list or a list of those -> a non-empty list."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field}: must be a non-empty string, list of strings or list of token-id lists")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [list(value)]
    if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        if any(isinstance(v, list) and not v for v in value):
            raise ValueError(f"{field}: a token-id list is empty")
        return list(value)
    raise ValueError(f"{field}: mix of strings and token ids")


def truncate_ids(ids: list[int], keep: int, side: str) -> list[int]:
    """vLLM's rule for token ids: keep `keep` of them from the end the tokenizer truncates
    (`truncation_side`, "right" unless tokenizer_config.json says "left"): the first ones for "right",
    the last ones for "left". Text goes through the tokenizer's own truncation, which cuts the same end
    (keeping its special tokens), so a text and its token ids are cut alike."""
    return list(ids[-keep:]) if side == "left" else list(ids[:keep])


def tokenize(tokenizer, inputs: list, truncate: int | None, max_model_len: int, vocab_size: int,
             add_special_tokens: bool = True, do_lower_case: bool = False) -> list[TokenizedInput]:
    """Texts go through the tokenizer in one batch call (Rust, parallel); token-id lists are checked.
    do_lower_case (sentence_bert_config.json's): texts are lower-cased first, as vLLM and
    sentence-transformers < 6 do."""
    if truncate is not None and truncate == -1:
        truncate = max_model_len
    if truncate is not None and truncate < 1:
        raise ValueError(f"truncate_prompt_tokens: must be -1 or >= 1, got {truncate}")
    if truncate is not None and truncate > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {truncate} is past the model's maximum context length "
                         f"{max_model_len}")
    texts = [(i, v.lower() if do_lower_case else v) for i, v in enumerate(inputs) if isinstance(v, str)]
    out: list[list[int]] = [[] for _ in inputs]
    if texts:
        kw = dict(truncation=True, max_length=truncate) if truncate else {}
        enc = tokenizer([t for _, t in texts], add_special_tokens=add_special_tokens, **kw)["input_ids"]
        for (i, _), ids in zip(texts, enc):
            out[i] = list(ids)
    side = getattr(tokenizer, "truncation_side", "right")
    for i, v in enumerate(inputs):
        if isinstance(v, list):
            bad = [t for t in v if not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"input: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
            out[i] = truncate_ids(v, truncate, side) if truncate else list(v)
    if any(not ids for ids in out):
        raise ValueError("input: an input has no tokens (this tokenizer adds no special tokens to an empty text)")
    return [(ids, None) for ids in out]


def tokenize_pairs(tokenizer, firsts: list[str], seconds: list[str], max_model_len: int,
                   do_lower_case: bool = False) -> list[TokenizedInput]:
    """Cross-encoder inputs: each (first, second) as one sequence with its segment ids."""
    if do_lower_case:
        firsts, seconds = [t.lower() for t in firsts], [t.lower() for t in seconds]
    enc = tokenizer(firsts, seconds, truncation=True, max_length=max_model_len)
    types = enc.get("token_type_ids") or [None] * len(firsts)
    return [(list(ids), list(t) if t is not None else None) for ids, t in zip(enc["input_ids"], types)]


def check_dimensions(info: PoolingModelInfo, dimensions: int | None, hidden: int) -> None:
    if dimensions is None:
        return
    if info.matryoshka_dimensions is None:
        raise ValueError("dimensions: this model does not support Matryoshka representation (config.json declares "
                         "no matryoshka_dimensions); leave dimensions out")
    if dimensions < 1 or dimensions > hidden:
        raise ValueError(f"dimensions: must be in [1, {hidden}], got {dimensions}")
    if info.matryoshka_dimensions and dimensions not in info.matryoshka_dimensions:
        raise ValueError(f"dimensions: {dimensions} is not one of the model's Matryoshka dimensions "
                         f"{list(info.matryoshka_dimensions)}")


def embedding(row: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """`row`: the post-processed embedding (pooler.Pooler.postprocess). A Matryoshka cut keeps its
    first `dimensions` values and normalizes again, as vLLM."""
    if dimensions is None:
        return row.astype(np.float32)
    cut = row[:dimensions].astype(np.float32)
    return cut / max(float(np.linalg.norm(cut)), 1e-12) if normalize else cut


def probabilities(logits: np.ndarray, activation: bool) -> np.ndarray:
    """One label: sigmoid (a relevance score); several: softmax."""
    logits = logits.astype(np.float64)
    if not activation:
        return logits.astype(np.float32)
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    e = np.exp(logits - logits.max())
    return (e / e.sum()).astype(np.float32)


def encode_embedding(vec: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """base64 of the little-endian float32 bytes, or the floats as a contiguous float32 array (the
    response is written by orjson, which serializes numpy itself)."""
    if encoding_format == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return np.ascontiguousarray(vec, np.float32)


def pair_lists(text_1: object, text_2: object) -> tuple[list[str], list[str]]:
    """vLLM's /score: 1:1, 1:N (text_1 repeated) or N:N (zipped)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1: and text_2 must be non-empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_2: {len(second)} texts for {len(first)} in text_1; give one text_1 or as many as text_2")
    return first, second
