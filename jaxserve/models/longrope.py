"""LongRoPE (Phi-3 / Phi-3.5 / Phi-4-mini's `rope_scaling` type `longrope`, older files `su`): a
rescaling factor per rotary frequency, one set (`short_factor`) for contexts within the pretraining
length `original_max_position_embeddings` and another (`long_factor`) past it, and an attention
factor multiplied into cos and sin (sqrt(1 + ln(max_position_embeddings / original) / ln(original))
unless the config gives one).

Which set a request uses. transformers picks per forward pass by that pass's longest position, so
in its generate() a prompt shorter than the original length starts with the short set and switches
to the long one mid-sequence, leaving keys of both sets in one cache. jaxserve never mixes: it
follows vLLM, one set for the whole engine, the long one when `max_model_len` exceeds
`original_max_position_embeddings` (a request may then reach past it) and the short one otherwise
(no request can). Within the short engine every request equals transformers'; within the long one a
prompt past the original length equals transformers' too, and a shorter one equals transformers'
forward with the long set (what it would compute over the request's whole sequence once past).
Serve with `--max-model-len` at most the original length (4096 for Phi-3-mini-128k) to keep the
short set for short prompts.

Config layout (ModelConfig.rope_scaling, rope_type "longrope"):
    (original_max_position_embeddings, attention_factor, use_long (0.0 / 1.0), *short_factor, *long_factor)
with use_long set from max_position_embeddings when read (vLLM's default max_model_len) and by the
engine from the max_model_len it serves (`for_max_model_len`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

import numpy as np

# "ModelConfig" below is jaxserve.models.config.ModelConfig, named as a string only: config.py imports
# this module to read config.json, so importing it here (even for type checking) is a cycle.

ROPE_TYPES = ("longrope", "su")  # config.json's names (su: the first Phi-3 releases)


def from_hf(hf: Mapping, params: Mapping) -> tuple[float, ...]:
    """The rope_scaling tuple from config.json (`params`: its rope_scaling / rope_parameters dict);
    ValueError naming the field that is missing or of the wrong length."""
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings")
    original, max_pos = float(original), float(hf.get("max_position_embeddings", 4096))
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    rotary = int(head_dim * float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))))
    factors = []
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, (list, tuple)) or len(values) != rotary // 2:
            raise ValueError(f"rope_scaling.{key}: longrope needs a list of rotary_dim / 2 = {rotary // 2} "
                             f"factors; got {values!r:.80}")
        factors.append([float(v) for v in values])
    factor = params.get("factor")  # transformers: without one, the ratio of the lengths
    factor = max_pos / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return (original, float(attention), float(max_pos > original), *factors[0], *factors[1])


def from_gguf(original: float, max_pos: float, attention: float | None, short: np.ndarray,
              long: np.ndarray) -> tuple[float, ...]:
    """The same tuple from a GGUF file (llama.cpp's phi3: rope.scaling.original_context_length,
    rope.scaling.attn_factor and the rope_factors_short / rope_factors_long tensors)."""
    if attention is None:
        attention = 1.0 if max_pos <= original else math.sqrt(1 + math.log(max_pos / original) / math.log(original))
    return (float(original), float(attention), float(max_pos > original),
            *np.asarray(short, np.float64).ravel().tolist(), *np.asarray(long, np.float64).ravel().tolist())


def check(cfg: "ModelConfig", rotary_dim: int) -> None:
    """ValueError unless rope_scaling holds the layout above for `rotary_dim` rotating dims."""
    if len(cfg.rope_scaling) != 3 + rotary_dim:
        raise ValueError(f"rope_scaling for longrope must be (original_max_position_embeddings, attention_factor, "
                         f"use_long, {rotary_dim // 2} short factors, {rotary_dim // 2} long factors); "
                         f"got {len(cfg.rope_scaling)} values")


def original_length(cfg: "ModelConfig") -> int:
    return int(cfg.rope_scaling[0])


def attention_factor(cfg: "ModelConfig") -> float:
    return cfg.rope_scaling[1]


def uses_long(cfg: "ModelConfig") -> bool:
    return cfg.rope_scaling[2] > 0


def factors(cfg: "ModelConfig") -> np.ndarray:
    """The rescaling factors in use (short or long), [rotary_dim // 2] float64: inv_freq is divided by them."""
    half = (len(cfg.rope_scaling) - 3) // 2
    start = 3 + half if uses_long(cfg) else 3
    return np.asarray(cfg.rope_scaling[start:start + half], np.float64)


def for_max_model_len(cfg: "ModelConfig", max_model_len: int) -> "ModelConfig":
    """`cfg` with the factor set an engine of `max_model_len` uses for every request (the long one
    when a request can pass original_max_position_embeddings); any other config as it is."""
    if cfg.rope_type != "longrope":
        return cfg
    use_long = float(max_model_len > original_length(cfg))
    return cfg if use_long == cfg.rope_scaling[2] else replace(
        cfg, rope_scaling=(*cfg.rope_scaling[:2], use_long, *cfg.rope_scaling[3:]))
