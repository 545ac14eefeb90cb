"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k
RMSNorm) and a softmax top-k router over `num_experts` SwiGLU experts, renormalised only when
config.json's `norm_topk_prob` says so (the class default is false); `mlp_only_layers` and
`decoder_sparse_step` make some layers dense (see moe_layers.py)."""

from __future__ import annotations

from typing import Mapping

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import ATTENTION_TENSORS, MLP_TENSORS, qwen_fields
from jaxserve.models.moe_layers import (expert_readers, mixed_layer_tensors, moe_config, moe_ffn,
                                        moe_param_shapes, moe_partition_rules)

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def config_fields(hf: Mapping, arch: str) -> dict:
    return {**qwen_fields(hf, qk_norm=True, bias=False), "moe": moe_config(hf)}


def layer_tensors(cfg: ModelConfig) -> dict:
    tensors = {**ATTENTION_TENSORS, **expert_readers(cfg, ("mlp",), EXPERT_NAMES)}
    if cfg.moe and cfg.moe.dense_layers:
        tensors.update(MLP_TENSORS)
    return mixed_layer_tensors(cfg, tensors)


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=moe_param_shapes,
                              layer_tensors=layer_tensors, ffn=moe_ffn, partition_rules=moe_partition_rules)
