"""Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v
bias, `qkv_bias`), Qwen3-MoE's router and experts, plus a shared expert every token passes
through, scaled by a sigmoid gate: out = moe(x) + sigmoid(x @ ws_router) * swiglu_ws(x)."""

from __future__ import annotations

from typing import Mapping

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import ATTENTION_TENSORS, MLP_TENSORS, qwen_fields
from jaxserve.models.moe_layers import (expert_readers, mixed_layer_tensors, moe_config, moe_ffn,
                                        moe_param_shapes, moe_partition_rules, shared_expert_tensors)

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def config_fields(hf: Mapping, arch: str) -> dict:
    fields = qwen_fields(hf, qk_norm=False, bias=bool(hf.get("qkv_bias", True)))
    fields["attention_bias"] = bool(hf.get("qkv_bias", True))
    return {**fields, "moe": moe_config(hf, shared=True)}


def layer_tensors(cfg: ModelConfig) -> dict:
    tensors = {**ATTENTION_TENSORS, **expert_readers(cfg, ("mlp",), EXPERT_NAMES)}
    if cfg.moe and cfg.moe.shared_expert_intermediate_size:
        tensors.update(shared_expert_tensors())
    if cfg.moe and cfg.moe.dense_layers:
        tensors.update(MLP_TENSORS)
    return mixed_layer_tensors(cfg, tensors)


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=moe_param_shapes,
                              layer_tensors=layer_tensors, ffn=moe_ffn, partition_rules=moe_partition_rules)
