"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 text (`Gemma3ForCausalLM`), as transformers'
modeling_gemma2 / modeling_gemma3 compute them.

What differs from the Llama layer (so the family runs its own decoder, `ModelFamily.forward`):

    embeddings  scaled by sqrt(hidden), the factor rounded to the model dtype first (as HF's buffer)
    norms       RMSNorm times (1 + w), in float32, cast back after the product; four per layer:
                input -> attention -> post-attention norm -> residual;
                pre-feed-forward -> MLP -> post-feed-forward norm -> residual
    MLP         GeGLU: gelu_tanh(gate) * up
    attention   q.k scaled by query_pre_attn_scalar ** -0.5 (ModelConfig.attn_scale); Gemma 2 caps the
                scores (tanh(s / cap) * cap, in every attention backend) and the final logits (the
                sampler's head: ModelConfig.final_logit_softcap); sliding and global layers by
                `layer_types` (each layer's `sliding` flag is data, llama.layer_window)
    Gemma 3     q/k RMSNorm per head (1 + w) before RoPE; sliding layers rotate with their own base
                (rope_local_base_freq, unscaled), global ones with rope_theta and the config's scaling

Leaves: llama.attention_shapes' and llama.mlp_shapes', `mlp_norm` being the pre-feed-forward norm,
plus post_attn_norm, post_mlp_norm [L, hidden]. Norm weights are kept as the checkpoint's w (a GGUF
file's 1 + w is taken back to w when read, weights/gguf_file.py), so (1 + w) is formed in float32.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

import jax
import jax.numpy as jnp

from jaxserve.core.hybrid_kv_cache_manager import layer_slots
from jaxserve.models import attention, registry
from jaxserve.models.attention import AttentionMetadata
from jaxserve.models.config import ModelConfig, _rope_from_hf
from jaxserve.models.llama import (ATTENTION_TENSORS, MLP_TENSORS, attention_shapes, layer_window, mlp_shapes,
                                   sliding_flag, sm_scale)
from jaxserve.models.rope import apply_rope, inv_frequencies
from jaxserve.quantization.matmul import matmul

LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: x normalised and times (1 + w), both in float32, then cast to x's dtype
    (HF: `(x * (1 + w)).to(dtype)`, where Llama casts before the product)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def config_fields(hf: Mapping, arch: str) -> dict:
    """query_pre_attn_scalar, the soft caps, layer_types (default: Gemma 2 alternates sliding and
    global, Gemma 3 five sliding per global) and Gemma 3's local / global RoPE."""
    num_layers = int(hf["num_hidden_layers"])
    pattern = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern") or 6)
    types = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % pattern == 0] for i in range(num_layers)]
    if len(types) != num_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the "
                         f"{num_layers} layers; got {types}")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    caps = {k: (float(hf[key]) if hf.get(key) else None) for k, key in
            (("attn_logit_softcap", "attn_logit_softcapping"), ("final_logit_softcap", "final_logit_softcapping"))}
    # tied unless config.json says otherwise: the hub's Gemma configs leave it to the class default (True)
    out = {"attention_bias": bool(hf.get("attention_bias", False)), "qk_norm": arch == "Gemma3ForCausalLM",
           "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
           "attn_scale": float(hf.get("query_pre_attn_scalar") or 256) ** -0.5,  # transformers' default 256
           "sliding_layers": sliding if hf.get("sliding_window") else None, **caps}
    if arch == "Gemma3ForCausalLM":
        out.update(_gemma3_rope(hf))
    return out


def _gemma3_rope(hf: Mapping) -> dict:
    """transformers >= 5: rope_parameters {sliding_attention: {...}, full_attention: {...}}; older
    files: rope_theta (global), rope_local_base_freq and rope_scaling (global only)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention: rope_type {local['rope_type']!r} is not "
                             "supported (only the global layers' RoPE is scaled)")
        rope_type, scaling, theta = _rope_from_hf({"rope_parameters": {"rope_theta": 1_000_000.0, **full},
                                                   "max_position_embeddings": hf.get("max_position_embeddings")})
        local_theta = float(local.get("rope_theta", 10_000.0))
    else:
        rope_type, scaling, theta = _rope_from_hf({"rope_theta": 1_000_000.0, **hf})
        local_theta = float(hf.get("rope_local_base_freq") or 10_000.0)
    return {"rope_type": rope_type, "rope_scaling": scaling, "rope_theta": theta, "rope_local_theta": local_theta}


def param_shapes(cfg: ModelConfig) -> dict:
    shapes = attention_shapes(cfg)
    L, H = cfg.num_layers, cfg.hidden_size
    shapes["layers"].update(mlp_shapes(L, H, cfg.intermediate_size), post_attn_norm=(L, H), post_mlp_norm=(L, H))
    return shapes


def layer_tensors(cfg: ModelConfig) -> dict:
    return {**ATTENTION_TENSORS, **MLP_TENSORS, **(sliding_flag(cfg) if cfg.sliding_layers is not None else {}),
            "mlp_norm": ("pre_feedforward_layernorm.weight", False),
            "post_attn_norm": ("post_attention_layernorm.weight", False),
            "post_mlp_norm": ("post_feedforward_layernorm.weight", False)}


def geglu(cfg: ModelConfig, lp: dict, x: jax.Array, dots: jnp.dtype | None = None, **_: object) -> jax.Array:
    """x [T, hidden] -> [T, hidden]: down(gelu_tanh(gate) * up) (HF's gelu_pytorch_tanh)."""
    if "w_gate_up" in lp:  # fused layout (int8): one dot
        gate, up = jnp.split(matmul(x, lp["w_gate_up"], dots), 2, axis=-1)
    else:
        gate, up = matmul(x, lp["w_gate"], dots), matmul(x, lp["w_up"], dots)
    return matmul(jax.nn.gelu(gate, approximate=True) * up, lp["w_down"], dots)


def _attention(cfg: ModelConfig, backend: str, lp: dict, x: jax.Array, positions: jax.Array,
               kv: tuple[jax.Array, jax.Array], md: AttentionMetadata, layer: jax.Array,
               inv_freq: jax.Array, dots: jnp.dtype | None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One layer's attention from its normed input x [T, hidden]: projections, Gemma 3's q/k norms,
    RoPE with this layer's frequencies, the paged attention (scale, soft cap, window), o_proj."""
    t, hd = x.shape[0], cfg.head_dim
    if "wqkv" in lp:  # fused layout (int8): one dot
        nq, nkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q, k, v = jnp.split(matmul(x, lp["wqkv"], dots), [nq, nq + nkv], axis=-1)
    else:
        q, k, v = matmul(x, lp["wq"], dots), matmul(x, lp["wk"], dots), matmul(x, lp["wv"], dots)
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k, v = q.reshape(t, cfg.num_heads, hd), k.reshape(t, cfg.num_kv_heads, hd), v.reshape(t, cfg.num_kv_heads, hd)
    if cfg.qk_norm:
        q, k = gemma_norm(q, lp["q_norm"], cfg.rms_norm_eps), gemma_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    k_cache, v_cache = attention.write_kv(backend, kv[0], kv[1], k, v, md, layer)
    out = attention.attend(backend, q, k_cache, v_cache, md, layer, sm_scale=sm_scale(cfg),
                           sliding_window=layer_window(cfg, lp), soft_cap=cfg.attn_logit_softcap)
    return matmul(out.reshape(t, -1), lp["wo"], dots), (k_cache, v_cache)


def _frequencies(cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(global, local) inverse frequencies [head_dim // 2]: Gemma 3's sliding layers use their own
    base without the global layers' scaling; Gemma 2's layers all use the config's."""
    glob = jnp.asarray(inv_frequencies(cfg), jnp.float32)
    if cfg.rope_local_theta is None:
        return glob, glob
    local = replace(cfg, rope_theta=cfg.rope_local_theta, rope_type="default", rope_scaling=())
    return glob, jnp.asarray(inv_frequencies(local), jnp.float32)


def forward(params: dict, cfg: ModelConfig, kv_cache: tuple[jax.Array, jax.Array], token_ids: jax.Array,
            positions: jax.Array, md: AttentionMetadata, backend: str = "xla", bf16_dots_from: int = 0,
            lora_slots: jax.Array | None = None) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """llama.forward for Gemma: one ragged batch through the decoder -> (new cache, final-normed hidden)."""
    layers = params["layers"]
    if "lora_owner" in params or any(k.startswith("lora_") for k in layers):
        raise ValueError(f"enable_lora: LoRA adapters are not supported for {cfg.architecture} yet")
    if "k_scale" in layers:
        raise ValueError(f"{cfg.architecture}: fp8 KV scales from the checkpoint are not supported")
    emb = params["embed"][token_ids]
    h = emb * jnp.asarray(math.sqrt(cfg.hidden_size), emb.dtype)  # HF: the factor in the weights' dtype
    dots = jnp.bfloat16 if bf16_dots_from and h.shape[0] >= bf16_dots_from else None
    inv_global, inv_local = _frequencies(cfg)
    eps = cfg.rms_norm_eps

    def layer_body(carry, xs):
        h, k_cache, v_cache = carry
        lp, layer, group, slot = xs
        layer_md, pool_layer = attention.group_view(md, layer, group, slot)  # KV groups: its group's table
        inv = inv_global if "sliding" not in lp else jnp.where(lp["sliding"] > 0, inv_local, inv_global)
        attn, (k_cache, v_cache) = _attention(cfg, backend, lp, gemma_norm(h, lp["attn_norm"], eps), positions,
                                              (k_cache, v_cache), layer_md, pool_layer, inv, dots)
        h = h + gemma_norm(attn, lp["post_attn_norm"], eps)
        mlp = geglu(cfg, lp, gemma_norm(h, lp["mlp_norm"], eps), dots)
        return (h + gemma_norm(mlp, lp["post_mlp_norm"], eps), k_cache, v_cache), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    groups = slots = None  # with KV groups (worker/kv_groups.py): each layer's group and its pool slot
    if md.group_block_tables is None and kv_cache[0].ndim == 5 and kv_cache[0].shape[0] != cfg.num_layers:
        raise ValueError(f"a pool of {kv_cache[0].shape[0]}-layer blocks (KV groups) needs the batch's group "
                         "block tables (input_batch.pack num_groups)")
    if md.group_block_tables is not None:
        groups, slots = map(jnp.asarray, layer_slots(cfg.num_layers, cfg.sliding_layers, cfg.sliding_window))
    (h, k_cache, v_cache), _ = jax.lax.scan(layer_body, (h, *kv_cache), (layers, layer_ids, groups, slots))
    return (k_cache, v_cache), gemma_norm(h, params["final_norm"], eps)


def partition_rules(cfg: ModelConfig, tp: int) -> dict:
    """The base rules (parallel/specs.py); the extra norms and the sliding flag stay replicated."""
    return {}


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=param_shapes, layer_tensors=layer_tensors,
                              ffn=geglu, partition_rules=partition_rules, forward=forward)
