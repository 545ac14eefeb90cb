"""A vision-language model's weights by Hugging Face name (engine/weight_sync.py's get_weights /
update_weights / update_weights_from_disk for Qwen2-VL and Qwen2.5-VL): the language model's names are
hf_names.py's (model.layers.*, model.embed_tokens.weight, ...), the tower's are these.

    HF name (as the hub's files name them)           engine leaf (params["vision"])   layout change
    visual.patch_embed.proj.weight [D, C, T, P, P]   patch [C*T*P*P, D]               flattened, transposed
    visual.blocks.{i}.<name>       [out, in] / [n]   blocks/<leaf>[i]                  stacked; Linear transposed
    visual.merger.<name>                             merger/<leaf>                     Linear transposed

get_weights names them as the hub's files do (`visual.*`, `model.layers.*`; what transformers 4 and 5
save); update_weights also takes transformers 5's in-memory names (`model.visual.*`,
`model.language_model.*`), as the loader reads both (models/qwen2_vl.py's RENAMES). The tower's
`blocks/full` (which blocks attend over the whole image) comes from the config and has no name.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.vision.config import VisionConfig

PREFIX = "visual."
# transformers >= 5's module paths -> the names of the hub's files (and get_weights')
ALIASES = (("model.visual.", "visual."), ("model.language_model.", "model."))
# per-block leaf -> name under visual.blocks.{i}.; the Linear weights ([out, in]) are transposed
COMMON = {"norm1": "norm1.weight", "norm2": "norm2.weight", "qkv": "attn.qkv.weight", "qkv_b": "attn.qkv.bias",
          "proj": "attn.proj.weight", "proj_b": "attn.proj.bias"}
QWEN2_VL = {"norm1_b": "norm1.bias", "norm2_b": "norm2.bias", "fc1": "mlp.fc1.weight", "fc1_b": "mlp.fc1.bias",
            "fc2": "mlp.fc2.weight", "fc2_b": "mlp.fc2.bias"}
QWEN2_5_VL = {f"{p}{s}": f"mlp.{p}_proj.{'bias' if s else 'weight'}"
              for p in ("gate", "up", "down") for s in ("", "_b")}
MERGER = {"norm": "merger.ln_q.weight", "fc1": "merger.mlp.0.weight", "fc1_b": "merger.mlp.0.bias",
          "fc2": "merger.mlp.2.weight", "fc2_b": "merger.mlp.2.bias"}


def canonical(name: str) -> str:
    """`name` as the hub's files name it (transformers 5's model.visual.* / model.language_model.* mapped)."""
    for new, old in ALIASES:
        if name.startswith(new):
            return old + name[len(new):]
    return name


def vision_names(vc: VisionConfig) -> dict[str, tuple[str, str, int | None, bool]]:
    """Every tower tensor's HF name -> (group "patch"/"blocks"/"merger", leaf, block index or None, transposed)."""
    linear = lambda hf: hf.endswith(".weight") and "norm" not in hf and "ln_q" not in hf  # noqa: E731  [out, in]
    blocks = {**COMMON, **(QWEN2_VL if vc.kind == "qwen2_vl" else QWEN2_5_VL)}
    out = {PREFIX + "patch_embed.proj.weight": ("patch", "patch", None, True)}
    for i in range(vc.depth):
        out.update({f"{PREFIX}blocks.{i}.{hf}": ("blocks", leaf, i, linear(hf)) for leaf, hf in blocks.items()})
    merger = {**MERGER, **({"norm_b": "merger.ln_q.bias"} if vc.kind == "qwen2_vl" else {})}
    out.update({PREFIX + hf: ("merger", leaf, None, linear(hf)) for leaf, hf in merger.items()})
    return out


def _leaf(vision: Mapping, group: str, leaf: str) -> jax.Array:
    return vision["patch"] if group == "patch" else vision[group][leaf]


def hf_shape(vc: VisionConfig, vision: Mapping, name: str) -> tuple[int, ...]:
    """The HF shape of tower tensor `name` (`vision_names`' key)."""
    group, leaf, index, transpose = vision_names(vc)[name]
    if group == "patch":
        return (vc.hidden_size, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
    shape = tuple(_leaf(vision, group, leaf).shape)[0 if index is None else 1:]
    return shape[::-1] if transpose else shape


def to_hf(vc: VisionConfig, vision: Mapping, dtype: jnp.dtype, program: Callable) -> dict[str, jax.Array]:
    """The tower's tensors by HF name, in HF's layout and the model dtype (one small jitted program)."""
    names = vision_names(vc)

    def unstack(tree: Mapping) -> dict[str, jax.Array]:
        out = {}
        for name, (group, leaf, index, transpose) in names.items():
            x = _leaf(tree, group, leaf)
            x = x[index] if index is not None else x
            x = x.T if transpose else x
            out[name] = (x.reshape(hf_shape(vc, tree, name)) if group == "patch" else x).astype(dtype)
        return out
    return program(("vision",), unstack)(vision)


def split(weights: Mapping[str, object]) -> tuple[dict, dict]:
    """A {HF name: array} dict as (language model's, tower's), both under the hub's names."""
    lm, tower = {}, {}
    for name, value in weights.items():
        name = canonical(name)
        (tower if name.startswith(PREFIX) else lm)[name] = value
    return lm, tower


def updated(vc: VisionConfig, vision: Mapping, weights: Mapping[str, object]) -> dict:
    """The tower's tree with `weights` (tower names, any subset) written in, each new leaf placed as the
    served one (sharding, dtype). ValueError naming the first unknown / non-float / misshapen / non-finite
    tensor, before anything is placed."""
    names = vision_names(vc)
    host: dict[tuple[str, str], np.ndarray] = {}
    for name, value in weights.items():
        if name not in names:
            raise ValueError(f"{name}: not a parameter of this model (get_weights() lists its names)")
        arr = np.asarray(jax.device_get(value) if isinstance(value, jax.Array) else value)
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != jnp.bfloat16:
            raise ValueError(f"{name}: dtype {arr.dtype} is not a float dtype")
        if tuple(arr.shape) != hf_shape(vc, vision, name):
            raise ValueError(f"{name}: shape {tuple(arr.shape)}, expected {hf_shape(vc, vision, name)} "
                             "(Hugging Face's layout)")
        arr = arr.astype(np.float32)
        if not np.isfinite(arr).all():
            raise ValueError(f"{name}: non-finite values (NaN or inf)")
        group, leaf, index, transpose = names[name]
        if (group, leaf) not in host:
            host[(group, leaf)] = np.array(jax.device_get(_leaf(vision, group, leaf)), np.float32)
        arr = arr.reshape(arr.shape[0], -1) if group == "patch" else arr
        if index is None:
            host[(group, leaf)] = arr.T if transpose else arr
        else:
            host[(group, leaf)][index] = arr.T if transpose else arr
    out = {"patch": vision["patch"], "blocks": dict(vision["blocks"]), "merger": dict(vision["merger"])}
    for (group, leaf), arr in host.items():
        old = _leaf(vision, group, leaf)
        new = jax.device_put(arr.astype(np.dtype(old.dtype)), old.sharding)
        if group == "patch":
            out["patch"] = new
        else:
            out[group][leaf] = new
    return out
