"""What llama.cpp's GGUF files of the Phi-3, OLMo 2 and Granite families hold beyond a Llama file:
their architecture names, the tensor names that differ from Llama's, and the metadata read into
ModelConfig (weights/gguf_file.py asks this module; convert_hf_to_gguf.py is what wrote them).

    phi3     blk.N.attn_qkv (q, k, v fused as in the HF checkpoint), blk.N.ffn_up (gate and up fused);
             rope.dimension_count < head_dim: partial rotary (Phi-4-mini); the 128k models' LongRoPE as
             the tensors rope_factors_short / rope_factors_long with rope.scaling.original_context_length
             and rope.scaling.attn_factor; attention.sliding_window 0: none (Phi-4)
    olmo2    blk.N.post_attention_norm / post_ffw_norm (the norms after each sub-layer),
             attn_q_norm / attn_k_norm over the whole projection (their width tells them from per-head ones)
    granite  embedding_scale, residual_scale, logit_scale (a divisor), attention.scale

llama.cpp's converter permutes the q/k rows of granite (its converter is a LlamaModel), not of phi3
or olmo2.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from jaxserve.models import longrope

if TYPE_CHECKING:
    from gguf import GGUFReader

ARCHITECTURES = {"phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM"}
PERMUTED = ("granite",)  # q/k rows in llama.cpp's interleaved RoPE order (gguf_file._unpermute)

# HF name under model.layers.{i}. -> GGUF name under blk.{i}., where the family's differs from Llama's
LAYER_NAMES: dict[str, dict[str, str]] = {
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "olmo2": {"post_attention_layernorm.weight": "post_attention_norm.weight",
              "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}

Field = Callable[..., object]  # gguf_file.field bound to the reader: (key, default=None) -> value


def layer_name(arch: str, hf_name: str) -> str | None:
    """The family's GGUF name for a layer tensor, or None where it is Llama's."""
    return LAYER_NAMES.get(arch, {}).get(hf_name)


def config_fields(arch: str, reader: GGUFReader, field: Field, head_dim: int, path: Path) -> dict:
    """The family's ModelConfig fields from the file's metadata (and Phi-3's rope factor tensors)."""
    if arch == "granite":
        return {"embedding_multiplier": float(field("granite.embedding_scale", 1.0)),
                "residual_multiplier": float(field("granite.residual_scale", 1.0)),
                "logits_scaling": float(field("granite.logit_scale", 1.0)),
                "attn_scale": float(field("granite.attention.scale", 1.0))}
    if arch == "phi3":
        return _phi3(reader, field, head_dim, path)
    return {}


def _phi3(reader: GGUFReader, field: Field, head_dim: int, path: Path) -> dict:
    rotary = int(field("phi3.rope.dimension_count", head_dim))
    out: dict = {"partial_rotary_factor": rotary / head_dim}
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" not in tensors:
        return out
    if "rope_factors_short.weight" not in tensors:
        raise ValueError(f"{path}: rope_factors_long.weight without rope_factors_short.weight")
    original = field("phi3.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"{path}: LongRoPE factors without phi3.rope.scaling.original_context_length")
    attention = field("phi3.rope.scaling.attn_factor")
    scaling = longrope.from_gguf(float(original), float(field("phi3.context_length", 4096)),
                                 None if attention is None else float(attention),
                                 np.asarray(tensors["rope_factors_short.weight"].data, np.float32),
                                 np.asarray(tensors["rope_factors_long.weight"].data, np.float32))
    return {**out, "rope_type": "longrope", "rope_scaling": scaling}
