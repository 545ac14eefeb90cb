"""Which model code serves which HF `architectures` name (vLLM's ModelRegistry role).

    architecture (config.json)   family       module (imported on first use)
    LlamaForCausalLM             llama        jaxserve.models.llama
    MistralForCausalLM           mistral      jaxserve.models.llama
    Qwen2ForCausalLM             qwen2        jaxserve.models.llama
    Qwen3ForCausalLM             qwen3        jaxserve.models.llama
    Qwen2MoeForCausalLM          qwen2_moe    jaxserve.models.qwen2_moe
    Qwen3MoeForCausalLM          qwen3_moe    jaxserve.models.qwen3_moe
    MixtralForCausalLM           mixtral      jaxserve.models.mixtral
    GptOssForCausalLM            gpt_oss      jaxserve.models.gpt_oss
    Phi3ForCausalLM              phi3         jaxserve.models.phi3    (Phi-3, Phi-3.5, Phi-4; GGUF phi3)
    Olmo2ForCausalLM             olmo2        jaxserve.models.olmo2
    GraniteForCausalLM           granite      jaxserve.models.granite
    Gemma2ForCausalLM            gemma2       jaxserve.models.gemma
    Gemma3ForCausalLM            gemma3       jaxserve.models.gemma   (Gemma 3 text; GGUF gemma3)
    Qwen2_5_VLForConditionalGeneration  qwen2_5_vl  jaxserve.models.qwen2_vl  (images in: a vision tower,
    Qwen2VLForConditionalGeneration     qwen2_vl    jaxserve.models.qwen2_vl   M-RoPE; jaxserve/multimodal)
    DeepseekV2ForCausalLM        deepseek_v2  jaxserve.models.deepseek (latent attention: models/mla.py)
    DeepseekV3ForCausalLM        deepseek_v3  jaxserve.models.deepseek (V3, R1, Kimi K2)
    LlamaModel, Qwen3Model, ...  (the same)   bare decoders: embedders, no LM head (pooling)
    BertModel, XLMRobertaForSequenceClassification, ...   bert / roberta   jaxserve.models.bert
                                 encoders (pooling only): `_ENCODERS`, with the task each is made for

Each module defines `FAMILY`, a `ModelFamily`: the family's config reader (its fields of
ModelConfig from config.json), its parameter shapes, its weight-name map (our layer leaf ->
the checkpoint's tensor, or a reader that stacks per-expert tensors), its feed-forward block
(the part of the layer that differs from Llama's) and the PartitionSpecs of its own leaves.
The config reader, loader, sizing, sharding and `jaxserve plan` ask this module; adding a
family is one file plus one line of `_ARCHITECTURES` (or `register_model` from outside).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec

# "ModelConfig" in the annotations below is jaxserve.models.config.ModelConfig, named as a string
# only: config.py reads this registry, so importing it here (even for type checking) is a cycle.

# (tensor name -> host array; raises KeyError when absent)
TensorGetter = Callable[[str], "np.ndarray"]
# A layer leaf's source: (name under `model.layers.{i}.`, transpose [out, in] -> [in, out]?), or a
# reader (get, "model.layers.{i}.") -> the leaf's array for that layer (per-expert tensors stacked).
TensorSource = "tuple[str, bool] | Callable[[TensorGetter, str], np.ndarray]"


@dataclass(frozen=True)
class ModelFamily:
    # config.json -> this family's ModelConfig fields (beyond the common ones read in config.py)
    config_fields: Callable[[Mapping, str], dict]
    # ModelConfig -> {"embed": shape, "layers": {leaf: [L, ...] shape}, "final_norm": ..., "lm_head"?}
    param_shapes: Callable[["ModelConfig"], dict]
    # ModelConfig -> {layer leaf: TensorSource}
    layer_tensors: Callable[["ModelConfig"], dict]
    # (cfg, one layer's params, normed x [T, hidden], dots, backend=) -> [T, hidden]: the block after
    # attention; `backend` (keyword, the step's "xla" / "pallas") is passed to every family but dense Llama
    ffn: Callable[["ModelConfig", dict, "jax.Array", object], "jax.Array"]
    # (cfg, tensor_parallel_size) -> {layer leaf: (ok, PartitionSpec, why not)} for the family's own leaves
    partition_rules: Callable[["ModelConfig", int], dict]
    # a family whose layer differs beyond its feed-forward block (Gemma: post-norms, scaled embeddings)
    # runs its own decoder, with llama.forward's signature; None: llama.forward's layer scan
    forward: Callable | None = None
    # such a family's layer scan alone, with llama.run_layers' signature: what a pipeline stage runs
    # (DeepSeek); None with `forward` set: pipeline parallelism is refused for the family
    run_layers: Callable | None = None
    # (cfg, EngineArgs, the checkpoint's quant_method or None) -> None: ValueError naming a flag the
    # family cannot serve (DeepSeek's latent attention: TP, PP, ...), before any weight is read
    refuse_flags: Callable | None = None


_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "jaxserve.models.llama"),
    "MistralForCausalLM": ("mistral", "jaxserve.models.llama"),
    "Qwen2ForCausalLM": ("qwen2", "jaxserve.models.llama"),
    "Qwen3ForCausalLM": ("qwen3", "jaxserve.models.llama"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "jaxserve.models.qwen2_moe"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "jaxserve.models.qwen3_moe"),
    "MixtralForCausalLM": ("mixtral", "jaxserve.models.mixtral"),
    "GptOssForCausalLM": ("gpt_oss", "jaxserve.models.gpt_oss"),
    "Phi3ForCausalLM": ("phi3", "jaxserve.models.phi3"),
    "Olmo2ForCausalLM": ("olmo2", "jaxserve.models.olmo2"),
    "GraniteForCausalLM": ("granite", "jaxserve.models.granite"),
    "Gemma2ForCausalLM": ("gemma2", "jaxserve.models.gemma"),
    "Gemma3ForCausalLM": ("gemma3", "jaxserve.models.gemma"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "jaxserve.models.qwen2_vl"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "jaxserve.models.qwen2_vl"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "jaxserve.models.deepseek"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "jaxserve.models.deepseek"),
    # bare decoders (what sentence-transformers saves for an embedder: no LM head, names without
    # `model.`): the same families, served as pooling models (jaxserve/pooling/config.py)
    "LlamaModel": ("llama", "jaxserve.models.llama"),
    "MistralModel": ("mistral", "jaxserve.models.llama"),
    "Qwen2Model": ("qwen2", "jaxserve.models.llama"),
    "Qwen3Model": ("qwen3", "jaxserve.models.llama"),
}
# architectures without an LM head: their embedding table stands in for it (never sampled from)
HEADLESS_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
# encoders (bidirectional, whole prompts, no KV cache): pooling models only, served by the encoder
# runner over jaxserve.models.bert; architecture -> (family, task the checkpoint class is made for)
_ENCODERS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "embed"),
    "BertForSequenceClassification": ("bert", "classify"),
    "RobertaModel": ("roberta", "embed"),
    "RobertaForSequenceClassification": ("roberta", "classify"),
    "XLMRobertaModel": ("roberta", "embed"),
    "XLMRobertaForSequenceClassification": ("roberta", "classify"),
}


def encoder_architectures() -> dict[str, tuple[str, str]]:
    """The registered encoders: architecture -> (family, task)."""
    return _ENCODERS


def register_encoder(architecture: str, family: str, task: str) -> None:
    """Serve `architecture` as an encoder of `family` ("bert" or "roberta": its layout in models/bert.py)."""
    if family not in ("bert", "roberta") or task not in ("embed", "classify"):
        raise ValueError(f"register_encoder: family must be bert or roberta and task embed or classify; "
                         f"got {family!r}, {task!r}")
    _ENCODERS[architecture] = (family, task)


def register_model(architecture: str, family: str, module: str) -> None:
    """Serve `architecture` with `module`'s FAMILY (out-of-tree families, as vLLM's register_model)."""
    _ARCHITECTURES[architecture] = (family, module)


def supported_architectures() -> tuple[str, ...]:
    return tuple(_ARCHITECTURES)


def is_supported(architecture: str) -> bool:
    return architecture in _ARCHITECTURES


def family_name(architecture: str) -> str:
    """The family's short name (llama, qwen3_moe, ...); ValueError for an unknown architecture."""
    return _entry(architecture)[0]


def get_family(architecture: str) -> ModelFamily:
    """The ModelFamily serving `architecture` (its module imported on first use)."""
    return importlib.import_module(_entry(architecture)[1]).FAMILY


def resolve_architecture(hf: Mapping, source: str = "config.json") -> str:
    """The first of config.json's `architectures` that is registered; ValueError naming the supported ones."""
    archs = list(hf.get("architectures") or [])
    arch = next((a for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        encoder = next((a for a in archs if a in _ENCODERS), None)
        hint = f" ({encoder} is an encoder: serve it with --runner pooling)" if encoder else ""
        raise ValueError(f"{source}: unsupported architecture {archs or hf.get('model_type')!r}{hint}; "
                         f"supported: {', '.join(_ARCHITECTURES)}; encoders (pooling): {', '.join(_ENCODERS)}")
    return arch


def refuse_flags(cfg: "ModelConfig", args: object, checkpoint_quantization: str | None = None) -> None:
    """ValueError naming an engine flag (or the checkpoint's format) the model's family cannot serve."""
    hook = get_family(cfg.architecture).refuse_flags if is_supported(cfg.architecture) else None
    if hook is not None:
        hook(cfg, args, checkpoint_quantization)


def _entry(architecture: str) -> tuple[str, str]:
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(_ARCHITECTURES)}")
    return _ARCHITECTURES[architecture]
