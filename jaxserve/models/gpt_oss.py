"""gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b), as transformers' modeling_gpt_oss computes it.

What differs from the Llama block (everything else is llama.py's layer scan):

    attention   q/k/v/o with bias; attention sinks (`self_attn.sinks` [num_heads], a learned logit
                per head in the softmax denominator) passed to attention.attend; sliding-window and
                full layers alternating as config.json's `layer_types` says: each layer's `sliding`
                flag is data (llama.layer_window), so one layer body serves both kinds; YaRN RoPE
                (rope.py, its attention factor scaling cos and sin)
    router      [H, E] with bias: the top-k logits, then a softmax over those k (router "topk_softmax")
    experts     E experts of width I = intermediate_size, with biases, and the clamped SwiGLU:
                gate <= limit, up in [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate)

Checkpoint layout (transformers' save_pretrained; the experts stored fused, [in, out]):

    mlp.router.weight [E, H], mlp.router.bias [E]
    mlp.experts.gate_up_proj [E, H, 2I]   gate and up interleaved in the columns (gate even, up odd)
    mlp.experts.gate_up_proj_bias [E, 2I]  (the same interleaving)
    mlp.experts.down_proj [E, I, H], mlp.experts.down_proj_bias [E, H]

Leaves (on top of llama.attention_shapes: bq/bk/bv, plus bo, sinks, sliding):

    router [L, H, E]  router_bias [L, E]
    we_gate, we_up [L, E, I, H]  we_down [L, E, H, I]  be_gate, be_up [L, E, I]  be_down [L, E, H]

The experts are stored output-major as every family's (models/expert_weights.py: the bf16 tensors
transposed at load, the mxfp4 ones are so already). The interleaved gate/up columns are split into
we_gate / we_up at load, so tensor parallelism
splits I as for every MoE family (moe_layers.py) and expert parallelism splits E.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import ATTENTION_TENSORS, attention_shapes, sliding_flag
from jaxserve.models.moe import Experts, Router, moe
from jaxserve.models.moe_layers import MODEL_AXIS, moe_config, moe_partition_rules
from jaxserve.models.tensor_cuts import Cut, with_cuts
from jaxserve.quantization.mxfp4 import Mxfp4Weight, from_hub


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (GptOssExperts._apply_gate): (gate [C, I], up [C, I]) -> [C, I]."""
    alpha: float
    limit: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def config_fields(hf: Mapping, arch: str) -> dict:
    """Attention bias (default true), the sliding layers from layer_types (transformers' default:
    even layers slide), the top-k-then-softmax router and the clamped SwiGLU's constants."""
    num_layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the "
                         f"{num_layers} layers; got {types}")
    moe = moe_config(hf, router="topk_softmax", norm_topk_prob=False)
    moe = replace(moe, swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return {"attention_bias": bool(hf.get("attention_bias", True)), "moe": moe,
            "sliding_layers": sliding if hf.get("sliding_window") else None}


def param_shapes(cfg: ModelConfig) -> dict:
    m = _moe(cfg)
    L, H, E, I = cfg.num_layers, cfg.hidden_size, m.num_experts, m.moe_intermediate_size
    shapes = attention_shapes(cfg)
    shapes["layers"].update(bo=(L, H), sinks=(L, cfg.num_heads), router=(L, H, E), router_bias=(L, E),
                            we_gate=(L, E, I, H), we_up=(L, E, I, H), we_down=(L, E, H, I),
                            be_gate=(L, E, I), be_up=(L, E, I), be_down=(L, E, H))
    return shapes


def ffn(cfg: ModelConfig, lp: dict, x: jax.Array, dots=None, backend: str = "xla",
        valid: jax.Array | None = None) -> jax.Array:
    """x [T, H] -> [T, H]: the routed experts (gpt-oss has no dense layers and no shared expert);
    `backend`: the step's ("pallas": moe.moe's grouped matmul kernel, biases added per row);
    `valid`: the step's real tokens (moe.moe)."""
    m = _moe(cfg)
    router = Router(lp["router"], lp["router_bias"], m.num_experts_per_tok, False, m.router)
    experts = Experts(lp["we_gate"], lp["we_up"], lp["we_down"], lp["be_gate"], lp["be_up"], lp["be_down"],
                      ClampedSwiGLU(m.swiglu_alpha, m.swiglu_limit))
    return moe(x, router, experts, dots, m.expert_parallel, backend, valid)


def partition_rules(cfg: ModelConfig, tp: int) -> dict:
    """moe_layers' expert rules, the biases alike (E split with EP, else I; be_down is summed after the
    row-parallel down projection, so replicated without EP), sinks split with the q heads."""
    m = _moe(cfg)
    rules = moe_partition_rules(cfg, tp)
    q_ok = cfg.num_heads % tp == 0
    rules.update(sinks=(q_ok, P(None, MODEL_AXIS), f"num_heads {cfg.num_heads} not divisible by {tp}"),
                 router_bias=(True, P(), ""), bo=(True, P(), ""))
    ok, _, why = rules["we_gate"]  # the biases split when the experts do
    if m.expert_parallel:
        rules.update({k: (ok, P(None, MODEL_AXIS, None), why) for k in ("be_gate", "be_up", "be_down")})
    else:
        rules.update(be_gate=(ok, P(None, None, MODEL_AXIS), why), be_up=(ok, P(None, None, MODEL_AXIS), why),
                     be_down=(True, P(), ""))
    return rules


def layer_tensors(cfg: ModelConfig) -> dict:
    m = _moe(cfg)
    H, E, I = cfg.hidden_size, m.num_experts, m.moe_intermediate_size

    def fused(name: str, columns: slice | None):
        def read(get, prefix: str) -> np.ndarray | Mxfp4Weight:
            base = f"{prefix}mlp.experts.{name}"
            try:  # the hub's mxfp4 layout: [E, N, K / 32, 16] blocks, [E, N, K / 32] scales, N interleaved
                blocks = np.asarray(get(base + "_blocks"))
            except KeyError:
                arr = np.asarray(get(base))
                if arr.ndim == 3:  # a weight [E, in, out] -> [E, out, in]
                    arr = np.swapaxes(arr, 1, 2)
                    return arr if columns is None else arr[:, columns]  # de-interleave gate (even) / up (odd)
                return arr if columns is None else arr[..., columns]  # a bias [E, out]
            scales = np.asarray(get(base + "_scales"))
            return from_hub(*((blocks, scales) if columns is None else (blocks[:, columns], scales[:, columns])))
        # the weights API's name: the float tensor as transformers holds it, a weight [E, in, out], a bias [E, out]
        shape = {"gate_up_proj": (E, H, 2 * I), "down_proj": (E, I, H), "gate_up_proj_bias": (E, 2 * I),
                 "down_proj_bias": (E, H)}[name]
        sl = columns or slice(0, None, 1)
        return with_cuts(read, lambda prefix: (Cut(f"{prefix}mlp.experts.{name}", shape, axis=len(shape) - 1,
                                                   start=sl.start, step=sl.step, transpose=len(shape) == 3),))

    even, odd = slice(0, None, 2), slice(1, None, 2)
    return {**ATTENTION_TENSORS, **sliding_flag(cfg),
            "router": ("mlp.router.weight", True), "router_bias": ("mlp.router.bias", False),
            "we_gate": fused("gate_up_proj", even), "we_up": fused("gate_up_proj", odd),
            "we_down": fused("down_proj", None), "be_gate": fused("gate_up_proj_bias", even),
            "be_up": fused("gate_up_proj_bias", odd), "be_down": fused("down_proj_bias", None)}


def _moe(cfg: ModelConfig):
    if cfg.moe is None or cfg.moe.swiglu_limit is None:
        raise ValueError(f"{cfg.architecture}: config has no experts (num_local_experts)")
    return cfg.moe


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=param_shapes,
                              layer_tensors=layer_tensors, ffn=ffn, partition_rules=partition_rules)
