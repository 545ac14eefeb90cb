"""The model configuration, read from a transformers `config.json` dict.

One frozen dataclass covers every registered family (jaxserve/models/registry.py): Llama
2/3/3.1, Mistral, Qwen2/2.5 and Qwen3 differ only in q/k/v bias, q/k RMSNorm, RoPE scaling,
sliding window and tied embeddings; the Mixture-of-Experts families (Qwen2-MoE, Qwen3-MoE,
Mixtral) add a `MoeConfig`. The common fields are read here; each family's module reads its
own (`ModelFamily.config_fields`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Mapping

from jaxserve.models import longrope, registry

# architecture -> family name: a view of the registry, kept for the callers that list them
SUPPORTED_ARCHITECTURES: dict[str, str] = {a: registry.family_name(a) for a in registry.supported_architectures()}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")
# softmax_topk / topk_softmax: see MoeConfig.router; greedy, group_limited_greedy (V2's softmax scores)
# and noaux_tc (V3's sigmoid scores with a selection bias): DeepSeek's topk_method names, the family's
# own router (models/deepseek_router.py), with n_group / topk_group / routed_scaling_factor below
ROUTERS = ("softmax_topk", "topk_softmax", "greedy", "group_limited_greedy", "noaux_tc")
# config.json's names for the number of routed experts, by family
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeConfig:
    """The experts of a Mixture-of-Experts model (one per layer, the same in every sparse layer)."""
    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # one expert's width
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    # softmax_topk: softmax over all experts, then the top k (Qwen, Mixtral: renormalised);
    # topk_softmax: the top k logits, then a softmax over those k (gpt-oss)
    router: str = "softmax_topk"
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert with a sigmoid gate; 0: none
    # layers with a dense MLP of `intermediate_size` instead (mlp_only_layers, decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()
    expert_parallel: bool = False  # EngineArgs.enable_expert_parallel: experts split over the TP devices
    # gpt-oss's clamped SwiGLU: gate <= limit, up in [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate),
    # with biases on the experts; None: silu(gate) * up
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # DeepSeek's routers: experts in n_group groups, tokens routed within topk_group of them; the
    # weights times routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")

        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and topk_group "
                             f"({self.topk_group}) be in [1, n_group]")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def active_intermediate_size(self) -> int:
        """The expert width a token passes through: top-k experts plus the shared one."""
        return self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek V2/V3; models/mla.py): q through an optional low-rank
    bottleneck, K and V from one kv_lora_rank latent per token, a decoupled rotary key shared by the heads."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q projected directly (DeepSeek-V2-Lite)
    rope_interleave: bool = True  # the rotary dims in interleaved pairs (V2 always; V3 as config.json says)
    softmax_scale: float = 1.0  # qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2 or self.q_lora_rank < 0:
            raise ValueError(f"qk_rope_head_dim must be even (got {self.qk_rope_head_dim}) and q_lora_rank "
                             f">= 0 (got {self.q_lora_rank})")

    @property
    def cache_width(self) -> int:
        """One token's entry in one layer of the latent pool: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def num_experts_from_hf(hf: Mapping) -> int | None:
    """Routed experts under any of config.json's names (NUM_EXPERTS_KEYS), None when none is set."""
    for key in NUM_EXPERTS_KEYS:
        if hf.get(key):
            return int(hf[key])
    return None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a key of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    # llama3: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); linear: (factor,);
    # yarn: (factor, original_max_position_embeddings, beta_fast, beta_slow, truncate 1/0, attention_factor)
    rope_scaling: tuple[float, ...] = ()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    # the layers that use sliding_window (config.json's layer_types: gpt-oss alternates sliding and full
    # layers); None: every layer. Read at load time into each layer's `sliding` flag (a leaf, as data).
    sliding_layers: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # Mixture-of-Experts families only
    vision: "VisionConfig | None" = None  # a vision-language model's vision side (models/vision/config.py)
    # the attention's q.k scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_scale: float | None = None
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> tanh(s / cap) * cap before the softmax
    final_logit_softcap: float | None = None  # Gemma 2: logits -> tanh(l / cap) * cap (the sampler's head)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled); None: rope_theta
    # Granite's scalars (1.0: none): the embeddings times embedding_multiplier, each sub-layer's output
    # times residual_multiplier before its residual add, the logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of each head (Phi-4-mini)
    # DeepSeek V2/V3's latent attention (head_dim is then its q/k head, nope + rope dims); None: per-head K, V
    mla: MlaConfig | None = None

    def __post_init__(self) -> None:
        registry.family_name(self.architecture)  # ValueError naming the supported ones
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.rope_type == "longrope":
            longrope.check(self, int(self.head_dim * self.partial_rotary_factor))
        if self.rope_type == "yarn" and len(self.rope_scaling) != 6:
            raise ValueError("rope_scaling for yarn must be (factor, original_max_position_embeddings, beta_fast, "
                             f"beta_slow, truncate, attention_factor); got {self.rope_scaling}")
        if self.sliding_layers is not None and any(i < 0 for i in self.sliding_layers):
            raise ValueError(f"sliding_layers must be layer indices >= 0; got {self.sliding_layers}")

    @property
    def family(self) -> str:
        return registry.family_name(self.architecture)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        d = dict(d)
        if d.get("vision") is not None:
            from jaxserve.models.vision.config import VisionConfig

            d["vision"] = VisionConfig.from_dict(d["vision"])
        d["rope_scaling"] = tuple(d.get("rope_scaling") or ())
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("sliding_layers") is not None:
            d["sliding_layers"] = tuple(d["sliding_layers"])
        if d.get("moe") is not None:
            moe = dict(d["moe"])
            moe["dense_layers"] = tuple(moe.get("dense_layers") or ())
            d["moe"] = MoeConfig(**moe)
        if d.get("mla") is not None:
            d["mla"] = MlaConfig(**d["mla"])
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Mapping, source: str = "config.json") -> "ModelConfig":
        """Build from a transformers config dict; `source` names the file in errors."""
        arch = registry.resolve_architecture(hf, source)
        if isinstance(hf.get("text_config"), Mapping):  # a vision-language config.json (transformers >= 5):
            hf = {**hf["text_config"], **hf}  # the language model's fields there, the top level's first
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            rope_type, rope_scaling, rope_theta = _rope_from_hf(hf)
            sliding = hf.get("sliding_window")
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            common = dict(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_type=rope_type,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False))
                or arch in registry.HEADLESS_ARCHITECTURES,
                attention_bias=bool(hf.get("attention_bias", False)),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            return cls(**{**common, **registry.get_family(arch).config_fields(hf, arch)})
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None


def with_expert_parallel(cfg: ModelConfig, enable: bool) -> ModelConfig:
    """`cfg` with its experts split over the TP devices (EngineArgs.enable_expert_parallel); a dense
    model is returned as is (vLLM ignores the flag there too)."""
    if cfg.moe is None or cfg.moe.expert_parallel == enable:
        return cfg
    return replace(cfg, moe=replace(cfg.moe, expert_parallel=enable))


def _rope_from_hf(hf: Mapping) -> tuple[str, tuple[float, ...], float]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files
    # write `rope_theta` and `rope_scaling` at the top level.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in longrope.ROPE_TYPES:  # Phi-3's su, LongRoPE's first name
        return "longrope", longrope.from_hf(hf, params), theta
    if rope_type == "llama3":
        scaling = (float(params["factor"]), float(params["low_freq_factor"]),
                   float(params["high_freq_factor"]), float(params["original_max_position_embeddings"]))
    elif rope_type == "linear":
        scaling = (float(params["factor"]),)
    elif rope_type == "yarn":
        scaling = _yarn_from_hf(hf, params)
    else:
        scaling = ()
    return rope_type, scaling, theta


def _yarn_from_hf(hf: Mapping, params: Mapping) -> tuple[float, ...]:
    """YaRN's fields as transformers' _compute_yarn_parameters reads them: factor (default
    max_position_embeddings / original), beta_fast 32, beta_slow 1, truncate (default true), and the
    attention factor that scales cos and sin (given, or from mscale / mscale_all_dim, or 0.1 ln(factor) + 1)."""
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(hf.get("max_position_embeddings", 4096)) / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    return (factor, original, float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
            float(bool(params.get("truncate", True))), float(attention))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
