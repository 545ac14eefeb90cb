"""The Llama-family model configuration, read from a transformers `config.json` dict.

One frozen dataclass covers Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3: they
differ only in q/k/v bias, q/k RMSNorm, RoPE scaling, sliding window and tied
embeddings, which are fields here rather than subclasses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


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
    # llama3: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); linear: (factor,)
    rope_scaling: tuple[float, ...] = ()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = tuple(d.get("rope_scaling") or ())
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Mapping, source: str = "config.json") -> "ModelConfig":
        """Build from a transformers config dict; `source` names the file in errors."""
        archs = list(hf.get("architectures") or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            rope_type, rope_scaling, rope_theta = _rope_from_hf(hf)
            sliding = hf.get("sliding_window")
            if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window", False):
                sliding = None
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
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
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None


def _rope_from_hf(hf: Mapping) -> tuple[str, tuple[float, ...], float]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files
    # write `rope_theta` and `rope_scaling` at the top level.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "llama3":
        scaling = (float(params["factor"]), float(params["low_freq_factor"]),
                   float(params["high_freq_factor"]), float(params["original_max_position_embeddings"]))
    elif rope_type == "linear":
        scaling = (float(params["factor"]),)
    else:
        scaling = ()
    return rope_type, scaling, theta
