"""DeepSeek V2 / V3 (`DeepseekV2ForCausalLM`: V2, V2-Lite, V2.5; `DeepseekV3ForCausalLM`: V3, R1,
Kimi K2), as transformers' modeling_deepseek_v2 / _v3 compute them.

    attention   multi-head latent attention over the latent pool (models/mla.py): q with or
                without q_lora_rank, the kv down-projection and its RMSNorm, decoupled rotary dims,
                YaRN with its mscale in the softmax scale
    MLP         the first `first_k_dense_replace` layers dense (and, as DeepSeek's own code, layers
                off `moe_layer_freq`); the others routed experts (moe.moe with DeepSeek's router,
                models/deepseek_router.py) plus n_shared_experts always-on experts, no gate
    router      V2: softmax scores, topk_method greedy / group_limited_greedy; V3: noaux_tc (sigmoid,
                e_score_correction_bias for selection only, groups by the sum of their top 2)

Leaves ([L, ...], weights [in, out]): attn_norm, mlp_norm; wq, or wq_a, q_a_norm, wq_b; wkv_a [hidden,
R + rope], kv_a_norm [R]; w_uk [H, nope, R], w_uv [H, v, R] (kv_b_proj split per head, for the absorbed
attention); wo [H * v, hidden]; router [hidden, E], e_bias [E] (V3); we_* (experts), ws_* (the shared
experts, width n_shared_experts * moe_intermediate_size); w_gate/w_up/w_down and `sparse` when some
layers are dense (each kind's leaves stacked over its own layers only: models/layer_kinds.py). A checkpoint's
multi-token-prediction layer (V3's model.layers.61) is past num_hidden_layers and is not read.

Tensor parallelism splits the heads (partition_rules) and replicates the latent pool; pipeline
parallelism gives each stage its layers' slice of it (run_layers, as every family's stages).
Block-wise FP8 checkpoints (V3 / R1 as the hub ships them) load: models/deepseek_weights.py.
Not served yet (refused at start-up, naming the flag): LoRA, --quantization,
checkpoints quantized otherwise than block-wise FP8. On the Pallas backends a decode step's attention
is the MLA decode kernel (models/mla.py, pallas_kernels/mla_decode.py).
"""

from __future__ import annotations

import logging
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.models import mla, registry
from jaxserve.models.attention import AttentionMetadata
from jaxserve.models.config import MlaConfig, ModelConfig, MoeConfig, _yarn_mscale
from jaxserve.models.deepseek_router import GroupedTopK
from jaxserve.models.deepseek_weights import kv_a_reader, kv_b_reader
from jaxserve.models.expert_weights import EXPERT_STACKS, LAYER_VIEWS, LayerStack
from jaxserve.models.llama import MLP_TENSORS, dense_mlp, mlp_shapes, rms_norm
from jaxserve.models.moe import Experts, Router, moe
from jaxserve.models.layer_kinds import KIND_INDEX, mixed_ffn, split_scanned, stack_shapes
from jaxserve.models.moe_layers import MODEL_AXIS, expert_readers, mixed_layer_tensors, moe_partition_rules

log = logging.getLogger(__name__)
V3 = "DeepseekV3ForCausalLM"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def config_fields(hf: Mapping, arch: str) -> dict:
    """The latent attention's and the router's fields; ValueError naming a field this code does not serve."""
    for field, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(field, want) != want:
            raise ValueError(f"{field}: {hf[field]!r} is not supported for {arch} (only {want!r})")
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    m = MlaConfig(kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                  v_head_dim=int(hf["v_head_dim"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                  rope_interleave=bool(hf.get("rope_interleave", True)) if arch == V3 else True,
                  softmax_scale=_softmax_scale(hf, nope + rope))
    if int(hf.get("num_nextn_predict_layers") or 0):  # V3's multi-token prediction: not a serving layer
        log.info("%s: the checkpoint's %s multi-token-prediction layer(s) (model.layers.%s and up) are not "
                 "loaded (no speculative decoding from them yet)", arch, hf["num_nextn_predict_layers"],
                 hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    return {"mla": m, "head_dim": nope + rope, "num_kv_heads": heads, "moe": _moe_config(hf, arch)}


def _softmax_scale(hf: Mapping, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under YaRN (transformers'
    yarn_apply_mscale: the non-rotary dims' scores grow with the context too)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    scale = qk_head_dim ** -0.5
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "default" and params.get("mscale_all_dim"):
        mscale = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


def _moe_config(hf: Mapping, arch: str) -> MoeConfig:
    """Routed experts (n_routed_experts), DeepSeek's topk_method (V3: noaux_tc whatever it says, as
    transformers), dense layers below first_k_dense_replace and off moe_layer_freq."""
    layers = int(hf["num_hidden_layers"])
    first, freq = int(hf.get("first_k_dense_replace") or 0), int(hf.get("moe_layer_freq") or 1)
    method = "noaux_tc" if arch == V3 else (hf.get("topk_method") or "greedy")
    if arch == V3 and hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func: {hf['scoring_func']!r} is not supported for {arch} (only 'sigmoid')")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"topk_method: {method!r} is not supported; {arch} routes with greedy, "
                         "group_limited_greedy or noaux_tc")
    grouped = method != "greedy"
    experts, top_k = int(hf["n_routed_experts"]), int(hf["num_experts_per_tok"])
    n_group = int(hf.get("n_group") or 1) if grouped else 1
    topk_group = int(hf.get("topk_group") or n_group) if grouped else 1
    if grouped and experts % n_group == 0 and top_k > topk_group * (experts // n_group):
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds the experts of topk_group ({topk_group}) groups "
                         f"of {experts // n_group}")
    return MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=int(hf["moe_intermediate_size"]),
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)), router=method,
                     shared_expert_intermediate_size=int(hf.get("n_shared_experts") or 0)
                     * int(hf["moe_intermediate_size"]),
                     dense_layers=tuple(i for i in range(layers) if i < first or i % freq),
                     n_group=n_group, topk_group=topk_group,
                     routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0))


def param_shapes(cfg: ModelConfig) -> dict:
    m, e = mla.mla(cfg), cfg.moe
    L, H, nh = cfg.num_layers, cfg.hidden_size, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    layers: dict = {"attn_norm": (L, H), "mlp_norm": (L, H)}
    if m.q_lora_rank:
        layers.update(wq_a=(L, H, m.q_lora_rank), q_a_norm=(L, m.q_lora_rank), wq_b=(L, m.q_lora_rank, nh * qk))
    else:
        layers["wq"] = (L, H, nh * qk)
    layers.update(wkv_a=(L, H, m.cache_width), kv_a_norm=(L, m.kv_lora_rank),
                  w_uk=(L, nh, m.qk_nope_head_dim, m.kv_lora_rank), w_uv=(L, nh, m.v_head_dim, m.kv_lora_rank),
                  wo=(L, nh * m.v_head_dim, H), router=(L, H, e.num_experts),
                  we_gate=(L, e.num_experts, e.moe_intermediate_size, H),
                  we_up=(L, e.num_experts, e.moe_intermediate_size, H),
                  we_down=(L, e.num_experts, H, e.moe_intermediate_size))
    if e.router == "noaux_tc":
        layers["e_bias"] = (L, e.num_experts)
    if e.shared_expert_intermediate_size:
        layers.update(mlp_shapes(L, H, e.shared_expert_intermediate_size, "ws"))
    if e.dense_layers:
        layers.update(mlp_shapes(L, H, cfg.intermediate_size), sparse=(L,))
    shapes = {"embed": (cfg.vocab_size, H), "layers": stack_shapes(cfg, layers), "final_norm": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    return shapes


def layer_tensors(cfg: ModelConfig) -> dict:
    attn = {"attn_norm": ("input_layernorm.weight", False), "mlp_norm": ("post_attention_layernorm.weight", False),
            "wq": ("self_attn.q_proj.weight", True), "wq_a": ("self_attn.q_a_proj.weight", True),
            "q_a_norm": ("self_attn.q_a_layernorm.weight", False), "wq_b": ("self_attn.q_b_proj.weight", True),
            "wkv_a": kv_a_reader(cfg), "kv_a_norm": ("self_attn.kv_a_layernorm.weight", False),
            "w_uk": kv_b_reader(cfg, 0), "w_uv": kv_b_reader(cfg, 1), "wo": ("self_attn.o_proj.weight", True)}
    tensors = {**attn, **expert_readers(cfg, ("mlp",), EXPERT_NAMES)}
    if cfg.moe.router == "noaux_tc":
        tensors["e_bias"] = ("mlp.gate.e_score_correction_bias", False)
    if cfg.moe.shared_expert_intermediate_size:
        tensors.update(ws_gate=("mlp.shared_experts.gate_proj.weight", True),
                       ws_up=("mlp.shared_experts.up_proj.weight", True),
                       ws_down=("mlp.shared_experts.down_proj.weight", True))
    if cfg.moe.dense_layers:
        tensors.update(MLP_TENSORS)
    return mixed_layer_tensors(cfg, tensors)


def ffn(cfg: ModelConfig, lp: dict, x: jax.Array, dots=None, backend: str = "xla",
        valid: jax.Array | None = None) -> jax.Array:
    """The routed experts plus the shared ones, or the dense MLP in a dense layer."""
    e = cfg.moe
    select = GroupedTopK(e.router, e.num_experts_per_tok, e.n_group, e.topk_group, e.norm_topk_prob,
                         e.routed_scaling_factor)

    def sparse(lp: dict, x: jax.Array) -> jax.Array:
        router = Router(lp["router"], None, e.num_experts_per_tok, e.norm_topk_prob, e.router, select, lp.get("e_bias"))
        out = moe(x, router, Experts(lp["we_gate"], lp["we_up"], lp["we_down"]), dots, e.expert_parallel,
                  backend, valid)
        return out + dense_mlp(cfg, lp, x, dots, prefix="ws") if e.shared_expert_intermediate_size else out

    return mixed_ffn(cfg, lp, x, sparse, lambda lp, x: dense_mlp(cfg, lp, x, dots))


def forward(params: dict, cfg: ModelConfig, kv_cache: tuple[jax.Array, jax.Array], token_ids: jax.Array,
            positions: jax.Array, md: AttentionMetadata, backend: str = "xla", bf16_dots_from: int = 0,
            lora_slots: jax.Array | None = None) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """llama.forward for DeepSeek: one ragged batch through the decoder -> (new pool, final-normed
    hidden). kv_cache: the latent pool (models/kv_layout.py)."""
    if "lora_owner" in params or any(k.startswith("lora_") for k in params["layers"]):
        raise ValueError(f"enable_lora: LoRA adapters are not supported for {cfg.architecture}")
    kv_cache, h = run_layers(params["layers"], cfg, kv_cache, params["embed"][token_ids], positions, md, backend,
                             bf16_dots_from)
    return kv_cache, rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def run_layers(layers: dict, cfg: ModelConfig, kv_cache: tuple[jax.Array, jax.Array], h: jax.Array,
               positions: jax.Array, md: AttentionMetadata, backend: str = "xla", bf16_dots_from: int = 0,
               lora_step: object = None) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """The residual stream h [T, hidden] through the stacked `layers` and their latent pool (llama.run_layers'
    signature: a pipeline stage calls it with its own slice of both, layer_kinds.stage_config's cfg).
    The expert stacks stay whole, read per layer (expert_weights.LayerStack), as llama.run_layers'."""
    if lora_step is not None:
        raise ValueError(f"enable_lora: LoRA adapters are not supported for {cfg.architecture}")
    dots = jnp.bfloat16 if bf16_dots_from and h.shape[0] >= bf16_dots_from else None
    inv_freq = jnp.asarray(mla.rope_frequencies(cfg), jnp.float32)
    lazy = {k: layers[k] for k in EXPERT_STACKS if k in layers}
    views = layers.get(LAYER_VIEWS, {})
    layers, local, kind_index = split_scanned({k: v for k, v in layers.items() if k not in lazy and k != LAYER_VIEWS})
    valid = md.slot_mapping >= 0  # padding rows are routed nowhere (moe.moe)

    def layer_body(carry, xs):
        h, pool, empty = carry
        lp, layer, row = xs  # row: the layer's index among its kind (dense or MoE: layer_kinds.py)
        lp = {**lp, **{k: LayerStack(v, row, views.get(k)) for k, v in lazy.items()}}
        if kind_index is not None:
            lp.update(local, **{KIND_INDEX: row})
        attn, pool = mla.attention(cfg, lp, rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps), positions, pool, md,
                                   layer, inv_freq, dots, backend)
        h = h + attn
        out = ffn(cfg, lp, rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps), dots, backend=backend, valid=valid)
        return (h + out, pool, empty), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    rows = layer_ids if kind_index is None else kind_index
    (h, pool, empty), _ = jax.lax.scan(layer_body, (h, *kv_cache), (layers, layer_ids, rows))
    return (pool, empty), h


def partition_rules(cfg: ModelConfig, tp: int) -> dict:
    """Tensor parallelism as vLLM's and sglang's: the heads of q (wq / wq_b columns), W_UK, W_UV and
    wo (rows: one all-reduce) split over the devices; the down-projections (wq_a, wkv_a) and their
    norms replicated, as the latent pool is (parallel/specs.py); the experts as every MoE family's."""
    ok = cfg.num_heads % tp == 0
    why = f"num_heads {cfg.num_heads} not divisible by tensor parallel size {tp}"
    heads = P(None, MODEL_AXIS, None, None)
    return {**moe_partition_rules(cfg, tp), "wq": (ok, P(None, None, MODEL_AXIS), why),
            "wq_b": (ok, P(None, None, MODEL_AXIS), why), "w_uk": (ok, heads, why), "w_uv": (ok, heads, why),
            "wo": (ok, P(None, MODEL_AXIS, None), why), "e_bias": (True, P(), "")}


def refuse_flags(cfg: ModelConfig, args, checkpoint_quantization: str | None) -> None:
    """ValueError naming what this family cannot serve yet, before any weight is read."""
    arch = cfg.architecture
    for flag, bad, why in (
            ("quantization", bool(args.quantization) and args.quantization != checkpoint_quantization,
             "its projections are not quantized on load yet"),
            ("quantization_config", checkpoint_quantization not in (None, "fp8"),
             f"{checkpoint_quantization} checkpoints do not load; block-wise fp8 (weight_block_size, as the hub "
             "ships V3) does")):
        if bad:
            raise ValueError(f"{flag}: not supported for {arch}: {why}")


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=param_shapes, layer_tensors=layer_tensors,
                              ffn=ffn, partition_rules=partition_rules, forward=forward, refuse_flags=refuse_flags,
                              run_layers=run_layers)
