"""Granite 3 (`GraniteForCausalLM`: granite-3.0/3.1/3.2/3.3 2b and 8b), as transformers'
modeling_granite computes it: Llama's layer and weights, with four scalars from config.json

    embedding_multiplier   the token embeddings are multiplied by it      (llama.embed)
    attention_multiplier   the attention's q.k scale, in place of head_dim ** -0.5 (ModelConfig.attn_scale)
    residual_multiplier    each sub-layer's output is multiplied by it before its residual add
    logits_scaling         the logits are divided by it                   (llama.final_hidden: the head's
                                                                           input, the head being linear)

each applied where HF applies it (none is folded into the weights, so LoRA adapters and
quantization see the checkpoint's own matrices).
"""

from __future__ import annotations

from typing import Mapping

from jax.sharding import PartitionSpec as P

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LAYER_TENSORS, _param_shapes, dense_mlp


def config_fields(hf: Mapping, arch: str) -> dict:
    """The four multipliers (transformers' defaults: 1.0), attention bias (on o_proj too)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported for {arch} (silu only)")
    if hf.get("mlp_bias"):
        raise ValueError(f"config.json: mlp_bias is not supported for {arch}")
    scalars = {}
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier"):
        value = float(hf.get(key, 1.0))
        if not value > 0:
            raise ValueError(f"config.json: {key} must be positive; got {value}")
        scalars[key] = value
    return {"attention_bias": bool(hf.get("attention_bias", False)), "attn_scale": scalars.pop("attention_multiplier"),
            **scalars}


def param_shapes(cfg: ModelConfig) -> dict:
    shapes = _param_shapes(cfg)
    if cfg.attention_bias:
        shapes["layers"]["bo"] = (cfg.num_layers, cfg.hidden_size)
    return shapes


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=param_shapes,
                              layer_tensors=lambda cfg: LAYER_TENSORS, ffn=dense_mlp,
                              partition_rules=lambda cfg, tp: {"bo": (True, P(), "")})
