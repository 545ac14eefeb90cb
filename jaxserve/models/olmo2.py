"""OLMo 2 (`Olmo2ForCausalLM`: OLMo-2-1124-7B/13B, OLMo-2-0325-32B, OLMo-2-0425-1B), as transformers'
modeling_olmo2 computes it: Llama's layer with the norms moved after each sub-layer,

    h = h + post_attention_layernorm(attention(h))      (no norm on the attention's input)
    h = h + post_feedforward_layernorm(mlp(h))          (no norm on the MLP's input)

and q/k RMSNorm over the whole projection (`self_attn.q_norm.weight` [nq*hd], `k_norm` [nkv*hd]),
before the heads are split and RoPE is applied, where Qwen3's norm is per head. Under tensor
parallelism q and k are split by heads: the norm's mean of squares runs over the whole projection
as a sum across the shards (XLA inserts it; the norm weights are replicated).

Leaves: Llama's without attn_norm / mlp_norm, plus attn_post_norm, mlp_post_norm [L, hidden] and
q_norm [L, nq*hd], k_norm [L, nkv*hd]; llama.run_layers picks the layout from the leaves present.
HF's OLMo 2 RMSNorm multiplies by its weight in float32 before casting back, Llama's after: the
same in float32, a bfloat16 rounding apart in bfloat16.
`--quantization int8` is refused (SmoothQuant folds its scales into pre-norms, which OLMo 2 lacks).
"""

from __future__ import annotations

from typing import Mapping

from jax.sharding import PartitionSpec as P

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LAYER_TENSORS, _param_shapes, dense_mlp


def config_fields(hf: Mapping, arch: str) -> dict:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported for {arch} (silu only)")
    return {"qk_norm": True, "attention_bias": bool(hf.get("attention_bias", False))}


def param_shapes(cfg: ModelConfig) -> dict:
    shapes = _param_shapes(cfg)
    layers = shapes["layers"]
    L, H = cfg.num_layers, cfg.hidden_size
    del layers["attn_norm"], layers["mlp_norm"]
    layers.update(q_norm=(L, cfg.num_heads * cfg.head_dim), k_norm=(L, cfg.num_kv_heads * cfg.head_dim),
                  attn_post_norm=(L, H), mlp_post_norm=(L, H))
    if cfg.attention_bias:  # HF: attention_bias puts a bias on o_proj too
        layers["bo"] = (L, H)
    return shapes


def layer_tensors(cfg: ModelConfig) -> dict:
    tensors = {k: v for k, v in LAYER_TENSORS.items() if k not in ("attn_norm", "mlp_norm")}
    return {**tensors, "attn_post_norm": ("post_attention_layernorm.weight", False),
            "mlp_post_norm": ("post_feedforward_layernorm.weight", False)}


def partition_rules(cfg: ModelConfig, tp: int) -> dict:
    """Llama's; the whole-projection norms and the o bias replicated."""
    return {"q_norm": (True, P(), ""), "k_norm": (True, P(), ""), "bo": (True, P(), "")}


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=param_shapes, layer_tensors=layer_tensors,
                              ffn=dense_mlp, partition_rules=partition_rules)
