"""Mixtral (`MixtralForCausalLM`: Mixtral-8x7B, 8x22B): Mistral's attention (sliding window when
config.json sets one) and `block_sparse_moe`: a softmax router, top-k (2), always renormalised,
over `num_local_experts` SwiGLU experts named w1 (gate), w3 (up), w2 (down). transformers >= 5
names the block `mlp` and may write the experts fused; both are read."""

from __future__ import annotations

from typing import Mapping

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import ATTENTION_TENSORS
from jaxserve.models.moe_layers import expert_readers, moe_config, moe_ffn, moe_param_shapes, moe_partition_rules

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def config_fields(hf: Mapping, arch: str) -> dict:
    return {"moe": moe_config(hf, norm_topk_prob=True)}


def layer_tensors(cfg: ModelConfig) -> dict:
    readers = expert_readers(cfg, ("block_sparse_moe", "mlp"), EXPERT_NAMES)
    return {**ATTENTION_TENSORS, **readers}


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=moe_param_shapes,
                              layer_tensors=layer_tensors, ffn=moe_ffn, partition_rules=moe_partition_rules)
