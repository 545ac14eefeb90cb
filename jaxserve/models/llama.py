"""The Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) as pure functions, and the
layer scan every registered family runs (jaxserve/models/registry.py): a family differs from
Llama only in its feed-forward block (`ModelFamily.ffn`: experts, a shared expert) and its own
leaves, so the attention half of the layer and the scan over stacked layers live here once.

Why pure functions over a dict pytree rather than flax nnx modules: the step is
one jitted function of (params, kv_cache, batch); the layers' weights are
stacked on a leading axis and `lax.scan`ned so one layer body is compiled
whatever the depth; and tensor parallelism needs a PartitionSpec per leaf.
All three are direct on a plain dict and need split/merge glue with nnx.

Params (weights stored [in, out] so activations multiply on the left):
    embed        [vocab, hidden]
    layers/      every leaf stacked on a leading [num_layers] axis:
      attn_norm  [L, hidden]          mlp_norm [L, hidden]
      wq [L, hidden, nq*hd]  wk, wv [L, hidden, nkv*hd]  wo [L, nq*hd, hidden]
      bq [L, nq*hd]  bk, bv [L, nkv*hd]               (attention_bias only)
      bo [L, hidden]  sinks [L, nq]  sliding [L]         (a family's: gpt-oss's o bias, attention
                                                          sinks, 1.0 where the layer's window slides)
      q_norm, k_norm [L, hd]                             (qk_norm only; OLMo 2: [L, nq*hd], [L, nkv*hd],
                                                          a norm over the whole projection)
      attn_post_norm, mlp_post_norm [L, hidden]          (OLMo 2, in place of attn_norm / mlp_norm:
                                                          each sub-layer's output normed before its residual)
      k_scale, v_scale [L]                   (a quantized checkpoint's fp8 KV scales, when it has them)
      w_gate, w_up [L, hidden, inter]  w_down [L, inter, hidden]
    final_norm   [hidden]
    lm_head      [hidden, vocab]                         (untied only)

Any matmul weight may be a `jaxserve.quantization.QuantizedWeight` (a quantized
checkpoint, or `--quantization`); every product goes through its one
`matmul(x, w)`, so this file never looks at a format. Layouts the model does
see: `--quantization int8` fuses wq|wk|wv into `wqkv` and w_gate|w_up into
`w_gate_up`, and always has an `lm_head` (tied: a quantized embed.T).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from typing import Mapping

from jaxserve.models import attention, layer_kinds, registry
from jaxserve.lora import layers as lora
from jaxserve.models.attention import AttentionMetadata
from jaxserve.models.config import ModelConfig
from jaxserve.models.expert_weights import EXPERT_STACKS, LAYER_VIEWS, LayerStack
from jaxserve.quantization.matmul import columns, matmul, matmul_transposed
from jaxserve.models.rope import apply_rope, attention_scale, inv_frequencies, mrope_positions

Params = dict[str, jax.Array | dict[str, jax.Array]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As HF: normalise in float32, cast back, then scale.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def project_qkv(cfg: ModelConfig, lp: dict, x: jax.Array, positions: jax.Array,
                inv_freq: jax.Array, dots: jnp.dtype | None = None,
                lora_step: lora.LoRAStep | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's q [T, nq, hd], k, v [T, nkv, hd] from its normed input: projections, biases,
    q/k norms and rope (float or quantized weights; `dots`: see run_layers; `lora_step`: the
    step's adapters, jaxserve/lora/layers.py)."""
    num_tokens = x.shape[0]
    if "wqkv" in lp:  # fused layout (int8): one dot
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = jnp.split(matmul(x, lp["wqkv"], dots), [nq, nq + nkv], axis=-1)
    else:
        q, k, v = matmul(x, lp["wq"], dots), matmul(x, lp["wk"], dots), matmul(x, lp["wv"], dots)
    q, k, v = (lora.add(y, lp, name, x, lora_step, dots) for y, name in ((q, "wq"), (k, "wk"), (v, "wv")))
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    whole = cfg.qk_norm and lp["q_norm"].shape[-1] != cfg.head_dim
    if whole:  # OLMo 2: q/k RMSNorm over the whole projection (all heads; under TP XLA sums across shards)
        q, k = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
    k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm and not whole:  # Qwen3: per head
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    scale = attention_scale(cfg)
    return apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale), v


def _attention_block(cfg: ModelConfig, backend: str, lp: dict[str, jax.Array], x: jax.Array,
                     positions: jax.Array, kv: tuple[jax.Array, jax.Array], md: AttentionMetadata,
                     layer: jax.Array, inv_freq: jax.Array,
                     dots: jnp.dtype | None = None,
                     lora_step: lora.LoRAStep | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    num_tokens = x.shape[0]
    q, k, v = project_qkv(cfg, lp, x, positions, inv_freq, dots, lora_step)
    if "k_scale" in lp:  # a checkpoint's fp8 KV scales: the pool holds k / k_scale and v / v_scale
        k, v, q = k / lp["k_scale"], v / lp["v_scale"], q * lp["k_scale"]
    k_cache, v_cache = attention.write_kv(backend, kv[0], kv[1], k, v, md, layer)
    out = attention.attend(backend, q, k_cache, v_cache, md, layer, sm_scale=sm_scale(cfg),
                           sliding_window=layer_window(cfg, lp), sinks=lp.get("sinks"))
    if "v_scale" in lp:
        out = out * lp["v_scale"].astype(out.dtype)
    out = out.reshape(num_tokens, -1)
    out = lora.add(matmul(out, lp["wo"], dots), lp, "wo", out, lora_step, dots)
    return (out + lp["bo"] if "bo" in lp else out), (k_cache, v_cache)


def sm_scale(cfg: ModelConfig) -> float:
    """The attention's q.k scale: the config's (Gemma: query_pre_attn_scalar ** -0.5), else head_dim ** -0.5."""
    return cfg.head_dim ** -0.5 if cfg.attn_scale is None else cfg.attn_scale


def layer_window(cfg: ModelConfig, lp: dict) -> int | jax.Array | None:
    """This layer's sliding window: the config's, or with per-layer windows (sliding_layers) an i32
    scalar picked by the layer's `sliding` flag, so every layer runs the same scanned body."""
    if "sliding" not in lp or cfg.sliding_window is None:
        return cfg.sliding_window
    return jnp.where(lp["sliding"] > 0, cfg.sliding_window, attention.FULL_WINDOW).astype(jnp.int32)


def forward(params: Params, cfg: ModelConfig, kv_cache: tuple[jax.Array, jax.Array],
            token_ids: jax.Array, positions: jax.Array, md: AttentionMetadata,
            backend: str = "xla", bf16_dots_from: int = 0,
            lora_slots: jax.Array | None = None, mm_embeds: jax.Array | None = None,
            mm_mask: jax.Array | None = None) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """One ragged batch through the decoder.

    token_ids, positions: [num_tokens] i32. kv_cache: (K, V), each
    [num_layers, num_kv_heads, num_blocks, block_size, head_dim], carried through
    the layer scan and updated in place (one scatter per layer) when donated.
    Returns the new cache and the final-normed hidden states [num_tokens, hidden].
    bf16_dots_from: see run_layers. lora_slots [T] i32: each token's adapter slot (0: none), used when
    the params carry LoRA slots (params["lora_owner"], jaxserve/lora/layers.py). A vision-language model
    (models/qwen2_vl.py): positions [3, T] (M-RoPE), and mm_embeds [T, hidden] taking the place of the
    embeddings of the rows where mm_mask [T] is set (its images' rows; jaxserve/multimodal/runner.py).
    """
    own = registry.get_family(cfg.architecture).forward
    if own is not None:  # a family with its own layer (models/gemma.py)
        return own(params, cfg, kv_cache, token_ids, positions, md, backend, bf16_dots_from, lora_slots)
    h = embed(params, cfg, token_ids)  # [T, hidden]
    if mm_embeds is not None:
        h = jnp.where(mm_mask[:, None], mm_embeds.astype(h.dtype), h)
    step = None
    if lora_slots is not None and "lora_owner" in params:  # the Pallas backends: decode-sized deltas by the kernel
        kernel = {"pallas": "pallas", attention.PALLAS_INTERPRET: "interpret"}.get(backend, "")
        step = lora.step_inputs(lora_slots, params["lora_owner"], kernel)
    kv_cache, h = run_layers(params["layers"], cfg, kv_cache, h, positions, md, backend, bf16_dots_from, step)
    return kv_cache, final_hidden(params, cfg, h)


def embed(params: Params, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """The token ids' embeddings [T, hidden], times Granite's embedding_multiplier (in their dtype, as HF)."""
    h = params["embed"][token_ids]
    return h if cfg.embedding_multiplier == 1.0 else h * cfg.embedding_multiplier


def final_hidden(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """The LM head's input: the final norm of h, divided by Granite's logits_scaling (the head is
    linear, so its logits come out divided, as HF divides them)."""
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return h if cfg.logits_scaling == 1.0 else h / cfg.logits_scaling


def _residual(cfg: ModelConfig, lp: dict, post_norm: str, h: jax.Array, out: jax.Array) -> jax.Array:
    """h + a sub-layer's output: normed first where the layer has that post-norm leaf (OLMo 2), times
    residual_multiplier (Granite)."""
    if post_norm in lp:
        out = rms_norm(out, lp[post_norm], cfg.rms_norm_eps)
    return h + (out if cfg.residual_multiplier == 1.0 else out * cfg.residual_multiplier)


def run_layers(layers: dict, cfg: ModelConfig, kv_cache: tuple[jax.Array, jax.Array], h: jax.Array,
               positions: jax.Array, md: AttentionMetadata,
               backend: str = "xla", bf16_dots_from: int = 0,
               lora_step: lora.LoRAStep | None = None) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """The residual stream h [T, hidden] through the stacked `layers` (leading axis n) and their
    cache (K, V each [n, ...]); a pipeline stage calls it with its own slice of both.
    bf16_dots_from > 0: a batch of that many tokens or more takes its float projections as
    bfloat16 x bfloat16 dots accumulated in float32 (the CPU's `--dtype auto`, engine/config.py);
    the weights stay as stored, and norms, attention and the residual stay in their own dtype."""
    family = registry.get_family(cfg.architecture)
    if family.run_layers is not None:  # a family with its own layer body (DeepSeek), reached by pipeline stages
        return family.run_layers(layers, cfg, kv_cache, h, positions, md, backend, bf16_dots_from, lora_step)
    if family.forward is not None:  # reached by pipeline stages only
        raise ValueError(f"pipeline_parallel_size: {cfg.architecture} runs its own layer body "
                         "(models/gemma.py); pipeline parallelism is not supported for it")
    inv_freq = jnp.asarray(inv_frequencies(cfg), jnp.float32)
    if positions.ndim == 2:  # M-RoPE's (time, height, width) positions: one per rotary frequency
        positions = mrope_positions(cfg, positions)
    dots = jnp.bfloat16 if bf16_dots_from and h.shape[0] >= bf16_dots_from else None

    ffn = registry.get_family(cfg.architecture).ffn  # Llama's dense MLP, or a family's experts
    # MoE expert stacks stay whole, read lazily at (layer, expert) by the expert block: sliced by the
    # scan, each layer's stacks were copied out every step (expert_weights.LayerStack); with them
    # come their layers as arrays of their own where the runner made them (LAYER_VIEWS).
    lazy = {k: layers[k] for k in EXPERT_STACKS if k in layers}
    views = layers.get(LAYER_VIEWS, {})
    # a model mixing dense and MoE layers: each kind's leaves stacked over its own layers (layer_kinds.py)
    layers, local, kind_index = layer_kinds.split_scanned(
        {k: v for k, v in layers.items() if k not in lazy and k != LAYER_VIEWS})

    def layer_body(carry, xs):
        h, k_cache, v_cache = carry
        lp, layer, row = xs
        lp = {**lp, **{k: LayerStack(v, row, views.get(k)) for k, v in lazy.items()}}
        if kind_index is not None:
            lp.update(local, **{layer_kinds.KIND_INDEX: row})
        # pre-norms where the layer has them (OLMo 2 has none: it norms each sub-layer's output instead)
        x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps) if "attn_norm" in lp else h
        attn_out, (k_cache, v_cache) = _attention_block(
            cfg, backend, lp, x, positions, (k_cache, v_cache), md, layer, inv_freq, dots, lora_step)
        h = _residual(cfg, lp, "attn_post_norm", h, attn_out)
        x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps) if "mlp_norm" in lp else h
        if lora_step is None and ffn is dense_mlp:
            out = dense_mlp(cfg, lp, x, dots)
        elif lora_step is None:  # a family's block, told the backend (MoE: the Pallas grouped matmul)
            out = ffn(cfg, lp, x, dots, backend=backend, valid=md.slot_mapping >= 0)  # valid: no padding
        elif ffn is dense_mlp:
            out = dense_mlp(cfg, lp, x, dots, lora_step=lora_step)
        else:
            raise ValueError(f"enable_lora: LoRA adapters are supported on dense models; {cfg.architecture} "
                             "is a mixture of experts")
        return (_residual(cfg, lp, "mlp_post_norm", h, out), k_cache, v_cache), None

    num_layers = jax.tree.leaves(layers["wo"])[0].shape[0]
    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    rows = layer_ids if kind_index is None else kind_index
    (h, k_cache, v_cache), _ = jax.lax.scan(layer_body, (h, *kv_cache), (layers, layer_ids, rows))
    return (k_cache, v_cache), h


def dense_mlp(cfg: ModelConfig, lp: dict, x: jax.Array, dots: jnp.dtype | None = None,
              prefix: str = "w", lora_step: lora.LoRAStep | None = None) -> jax.Array:
    """SwiGLU: x [T, hidden] -> [T, hidden] through lp[prefix + "_gate" / "_up" / "_down"], plus the
    step's LoRA deltas (lora_step: jaxserve/lora/layers.py) when it has adapters."""
    if prefix + "_gate_up" in lp:  # fused layout (int8): one dot
        gate, up = jnp.split(matmul(x, lp[prefix + "_gate_up"], dots), 2, axis=-1)
    else:
        gate, up = matmul(x, lp[prefix + "_gate"], dots), matmul(x, lp[prefix + "_up"], dots)
    gate = lora.add(gate, lp, prefix + "_gate", x, lora_step, dots)
    up = lora.add(up, lp, prefix + "_up", x, lora_step, dots)
    act = jax.nn.silu(gate) * up
    return lora.add(matmul(act, lp[prefix + "_down"], dots), lp, prefix + "_down", act, lora_step, dots)


def compute_logits(params: Params, hidden: jax.Array, soft_cap: float | None = None) -> jax.Array:
    """hidden: [N, hidden] -> float32 logits [N, vocab]; soft_cap: the model's final logit
    soft-capping (ModelConfig.final_logit_softcap, Gemma 2), applied as transformers does."""
    head = params.get("lm_head")
    logits = matmul(hidden, params["embed"].T if head is None else head)
    return cap_logits(logits.astype(jnp.float32), soft_cap)


def cap_logits(logits: jax.Array, soft_cap: float | None) -> jax.Array:
    """tanh(logits / cap) * cap (transformers' final_logit_softcapping), or the logits as they are."""
    return logits if soft_cap is None else jnp.tanh(logits / soft_cap) * soft_cap


def slice_logits(params: Params, hidden: jax.Array, start: jax.Array, size: int,
                 dots: jnp.dtype | None = None, soft_cap: float | None = None) -> jax.Array:
    """compute_logits' columns [start, start + size) (start may be traced): the head's columns
    only, from the tied embedding's rows or an lm_head's columns (float or int8)."""
    head = params.get("lm_head")
    if head is None:
        logits = matmul_transposed(hidden, jax.lax.dynamic_slice_in_dim(params["embed"], start, size, 0), dots)
    else:
        logits = matmul(hidden, columns(head, start, size), dots)
    return cap_logits(logits.astype(jnp.float32), soft_cap)


def param_shapes(cfg: ModelConfig) -> dict:
    """The expected shape of every parameter, to check loaded weights against (the family's tree)."""
    return registry.get_family(cfg.architecture).param_shapes(cfg)


def attention_shapes(cfg: ModelConfig) -> dict:
    """The tree around the layers' feed-forward blocks: embedding, attention and norm leaves, head."""
    L, H = cfg.num_layers, cfg.hidden_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {"attn_norm": (L, H), "mlp_norm": (L, H), "wq": (L, H, nq), "wk": (L, H, nkv),
              "wv": (L, H, nkv), "wo": (L, nq, H)}
    if cfg.attention_bias:
        layers.update(bq=(L, nq), bk=(L, nkv), bv=(L, nkv))
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    if cfg.sliding_layers is not None:
        layers["sliding"] = (L,)
    shapes = {"embed": (cfg.vocab_size, H), "layers": layers, "final_norm": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    return shapes


def mlp_shapes(num_layers: int, hidden: int, inter: int, prefix: str = "w") -> dict:
    return {f"{prefix}_gate": (num_layers, hidden, inter), f"{prefix}_up": (num_layers, hidden, inter),
            f"{prefix}_down": (num_layers, inter, hidden)}


def _param_shapes(cfg: ModelConfig) -> dict:
    shapes = attention_shapes(cfg)
    shapes["layers"].update(mlp_shapes(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size))
    return shapes


# our layer leaf -> (transformers name under model.layers.{i}., transpose?)
ATTENTION_TENSORS: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "bo": ("self_attn.o_proj.bias", False),
    "sinks": ("self_attn.sinks", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
}
MLP_TENSORS: dict[str, tuple[str, bool]] = {
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
LAYER_TENSORS = {**ATTENTION_TENSORS, **MLP_TENSORS}


def sliding_flag(cfg: ModelConfig) -> dict:
    """The reader of the `sliding` leaf (1.0 in the layers of cfg.sliding_layers), for a family with
    per-layer windows: the flag is data, so pipeline stages slice it with their layers."""
    layers = set(cfg.sliding_layers or ())
    return {"sliding": lambda get, prefix: np.float32(int(prefix.rstrip(".").rsplit(".", 1)[1]) in layers)}


def _config_fields(hf: Mapping, arch: str) -> dict:
    """Qwen2: q/k/v bias unless config.json says otherwise; Qwen3: q/k norm; both: the sliding
    window only with use_sliding_window. (Qwen2Model / Qwen3Model: the same, without an LM head.)"""
    family = arch.removesuffix("ForCausalLM").removesuffix("Model")
    return qwen_fields(hf, qk_norm=family == "Qwen3", bias=family == "Qwen2") if family in ("Qwen2", "Qwen3") else {}


def qwen_fields(hf: Mapping, qk_norm: bool, bias: bool) -> dict:
    """The Qwen families' attention fields (dense and MoE alike)."""
    out = {"qk_norm": qk_norm, "attention_bias": bool(hf.get("attention_bias", bias))}
    if not hf.get("use_sliding_window", False):
        out["sliding_window"] = None
    return out


def dense_partition_rules(cfg: ModelConfig, tp: int) -> dict:
    """Column-parallel gate/up, row-parallel down (the base rules in parallel/specs.py)."""
    return {}


FAMILY = registry.ModelFamily(
    config_fields=_config_fields, param_shapes=_param_shapes, layer_tensors=lambda cfg: LAYER_TENSORS,
    ffn=dense_mlp, partition_rules=dense_partition_rules)
