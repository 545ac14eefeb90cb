"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`):
a Qwen2 language model that reads images, as transformers' modeling_qwen2_vl / modeling_qwen2_5_vl.

    language model   Qwen2's decoder (llama.py's layer scan: q/k/v bias, SwiGLU), with M-RoPE: each
                     token has a (time, height, width) position and mrope_section splits the rotary
                     frequencies between the three (rope.mrope_positions); a text token's three are
                     equal, an image's rows take their place on the image's grid
    vision tower     models/vision/qwen2_vl_vision.py, its params under params["vision"]
    image rows       the tower's merged rows replace the placeholder tokens' (<|image_pad|>) input
                     embeddings at prefill (llama.forward's mm_embeds); jaxserve/multimodal/ builds
                     the prompt, the positions and the step's rows

Checkpoints name the language model `model.layers.*` (transformers < 5, the hub's files) or
`model.language_model.layers.*` (transformers >= 5), the tower `visual.*` or `model.visual.*`: both
are read (`tensor_getter`).
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LAYER_TENSORS, _param_shapes, dense_mlp, dense_partition_rules
from jaxserve.models.vision.config import vision_from_hf
from jaxserve.models.vision.qwen2_vl_vision import read_vision_params

KIND = {"Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
# where transformers >= 5 saves what older files keep at the top level
RENAMES = (("model.", "model.language_model."), ("visual.", "model.visual."))
# the engine flags these models cannot serve yet: (EngineArgs field, the value that is fine, why)
REFUSED = (("pipeline_parallel_size", 1, "the image rows enter on the first stage only"),
           ("enable_lora", False, "adapters on a vision-language model are not supported yet"),
           ("quantization", None, "the vision tower stays in the model dtype; quantizing the rest is untested"),
           ("batch_invariant", False, "the vision tower's batches are not batch-invariant"))


def config_fields(hf: Mapping, arch: str) -> dict:
    """Qwen2's attention (q/k/v bias), the vision side, and RoPE as the text config says without the
    "mrope" type (the sections are the VisionConfig's; the frequencies are the default ones)."""
    if hf.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window is not supported for the Qwen VL models")
    out = {"qk_norm": False, "attention_bias": True, "sliding_window": None, "vision": vision_from_hf(hf, KIND[arch])}
    if out["vision"].mrope_section and sum(out["vision"].mrope_section) * 2 != _head_dim(hf):
        raise ValueError(f"rope_parameters.mrope_section {list(out['vision'].mrope_section)} must sum to half "
                         f"the head dim ({_head_dim(hf) // 2})")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) in ("mrope", "default", None):
        out.update(rope_type="default", rope_scaling=())
    return out


def _head_dim(hf: Mapping) -> int:
    return int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))


def tensor_getter(get: Callable[[str], object]) -> Callable[[str], object]:
    """`get` answering the older names (model.layers.*, visual.*) from a transformers >= 5 file too."""
    def aliased(name: str):
        try:
            return get(name)
        except KeyError:
            for old, new in RENAMES:
                if name.startswith(old):
                    return get(new + name[len(old):])
            raise
    return aliased


def load_vision(cfg: ModelConfig, get: Callable[[str], object], dtype: jnp.dtype) -> dict:
    """The tower's params (models/vision/qwen2_vl_vision.py), read through tensor_getter's names."""
    return read_vision_params(cfg.vision, tensor_getter(get), dtype, "visual.")


def replicate_vision(params: dict, mesh: object | None) -> dict:
    """Under tensor parallelism the tower is whole on every device (replicated, as `jaxserve plan`
    counts it): it is small next to the language model, and each device then runs it on the step's
    images with no collective; the language model is split as llama's (parallel/specs.py)."""
    if mesh is None or "vision" not in params:
        return params
    from jax.sharding import NamedSharding, PartitionSpec

    return {**params, "vision": jax.device_put(params["vision"], NamedSharding(mesh, PartitionSpec()))}


def refuse_flags(cfg: ModelConfig, args: object, checkpoint_quantization: str | None = None) -> None:
    """ValueError naming a flag these models cannot serve (REFUSED), or a quantized checkpoint; before
    any weight is read."""
    for name, fine, why in REFUSED:
        value = getattr(args, name, fine)
        if value != fine and not (fine is None and not value):
            raise ValueError(f"{name}: {value!r} is not supported for {cfg.architecture} ({why})")
    if checkpoint_quantization:
        raise ValueError(f"model: a {checkpoint_quantization} checkpoint of {cfg.architecture} is not supported yet")


FAMILY = registry.ModelFamily(
    config_fields=config_fields, param_shapes=_param_shapes, layer_tensors=lambda cfg: LAYER_TENSORS,
    ffn=dense_mlp, partition_rules=dense_partition_rules, refuse_flags=refuse_flags)
