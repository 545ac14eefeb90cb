"""The served weights under Hugging Face's parameter names, and new weights by those names into the
engine's param tree: the contract of `LLM.get_weights()` / `LLM.update_weights()` (engine/weight_sync.py).

    HF name                                    engine leaf              layout change
    model.embed_tokens.weight  [vocab, H]      embed                    none (the same array)
    model.norm.weight          [H]             final_norm               none (the same array)
    lm_head.weight             [vocab, H]      lm_head [H, vocab]       transposed (untied only)
    model.layers.{i}.<name>    [out, in]       layers/<leaf>[i] [in, out]  stacked on axis 0, Linear
                                                                        weights transposed

The per-layer names are the loader's own map (registry `layer_tensors(cfg)`, the one assemble.py
reads checkpoints with), so a family's names are written once. A leaf the map gives as a reader
that reads no tensor (gpt-oss's `sliding` flag, a mixed MoE's `sparse` flag) comes from the config
and has no name; a reader that stacks per-expert tensors has no inverse here, so the MoE families
are updated through `engine_params()`' tree instead. Under `--quantization int8` the engine holds
wq|wk|wv as `wqkv` and w_gate|w_up as `w_gate_up` (quantization/quantize.py): they are split back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import param_shapes
from jaxserve.quantization.qweight import QuantizedWeight

TOP_LEVEL = {"embed": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False),
             "lm_head": ("lm_head.weight", True)}
# --quantization int8's fused leaves -> the float leaves they hold, in column order
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
# per-output-channel schemes a served weight can be read back from (values * scales)
DEQUANTIZABLE = ("int8", "fp8")


@dataclass(frozen=True)
class HFTensor:
    """Where one HF tensor lives in the engine's tree."""
    leaf: str  # "embed", "final_norm", "lm_head", or a layer leaf ("wq", "w_down", ...)
    layer: int | None  # the index on the stacked axis; None for the three top-level leaves
    transpose: bool  # HF stores it [out, in], the engine [in, out]
    shape: tuple[int, ...]  # HF's shape

    @property
    def path(self) -> str:
        """The engine leaf's path, as errors name it: layers/wq[3]."""
        return self.leaf if self.layer is None else f"layers/{self.leaf}[{self.layer}]"


def name_map(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Every HF parameter name the model has -> its place in the engine's float tree (param_shapes').
    ValueError for a family whose leaves are read from per-expert tensors."""
    shapes = param_shapes(cfg)
    out = {TOP_LEVEL[k][0]: HFTensor(k, None, TOP_LEVEL[k][1], tuple(shapes[k])[::-1] if TOP_LEVEL[k][1]
                                     else tuple(shapes[k])) for k in TOP_LEVEL if k in shapes}
    tensors = registry.get_family(cfg.architecture).layer_tensors(cfg)
    for leaf, shape in shapes["layers"].items():
        source = tensors[leaf]
        if callable(source):
            if _reads_tensors(source):
                raise ValueError(f"{cfg.architecture}: the engine leaf layers/{leaf} is stacked from per-expert "
                                 "tensors, which have no per-name form here; pass engine_params()' tree to "
                                 "update_weights instead of HF names")
            continue  # a flag from the config (sliding, sparse): not a weight
        hf, transpose = source
        per_layer = tuple(shape[1:])[::-1] if transpose else tuple(shape[1:])
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{hf}"] = HFTensor(leaf, i, transpose, per_layer)
    return out


def leaf_names(names: Mapping[str, HFTensor]) -> dict[tuple[str, int | None], str]:
    """(leaf, layer) -> HF name: the inverse, to name a parameter in an error."""
    return {(t.leaf, t.layer): n for n, t in names.items()}


def _reads_tensors(reader) -> bool:
    """Whether a layer_tensors reader reads the checkpoint (a weight) or only the config (a flag)."""
    def absent(name: str):
        raise KeyError(name)
    try:
        reader(absent, "model.layers.0.")
    except KeyError:
        return True
    return False


def float_layers(layers: Mapping, cfg: ModelConfig, dtype: jnp.dtype) -> dict:
    """The layer leaves as float arrays in the unfused layout: quantized leaves (int8 / fp8, one
    scale per output channel) dequantized to `dtype`, wqkv / w_gate_up split. Traced inside a
    program (weight_sync's), so it costs one pass over each leaf."""
    out = {}
    for leaf, value in layers.items():
        if isinstance(value, QuantizedWeight):
            if value.scheme not in DEQUANTIZABLE:
                raise ValueError(f"get_weights: layers/{leaf} is a {value.scheme} checkpoint weight; only float, "
                                 f"int8 and fp8 (per channel) engines are read back by name")
            value = (value.values.astype(jnp.float32) * value.scales).astype(dtype)
        if leaf in FUSED:
            nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            cuts = [nq, nq + nkv] if leaf == "wqkv" else [value.shape[-1] // 2]
            out.update(zip(FUSED[leaf], jnp.split(value, cuts, axis=-1)))
        else:
            out[leaf] = value
    return out


def unstack_leaf(stacked: jax.Array, transpose: bool) -> tuple[jax.Array, ...]:
    """[L, a, b] -> L arrays in HF's layout ([b, a] when transposed). Traced, one program per leaf."""
    return tuple(stacked[i].T if transpose else stacked[i] for i in range(stacked.shape[0]))


@dataclass(frozen=True)
class Given:
    """The validated update of one engine leaf: HF arrays by layer (key None: a top-level leaf)."""
    leaf: str
    transpose: bool
    arrays: dict[int | None, object]  # layer -> numpy or jax array, HF layout

    @property
    def on_host(self) -> bool:
        return all(isinstance(a, np.ndarray) for a in self.arrays.values())


def check_named(weights: Mapping[str, object], names: Mapping[str, HFTensor]) -> dict[str, Given]:
    """Group a {HF name: array} dict by engine leaf, checking every name, dtype and shape first:
    ValueError naming the first bad parameter (nothing is placed before the whole dict passes)."""
    grouped: dict[str, Given] = {}
    for name, value in weights.items():
        t = names.get(name)
        if t is None:
            raise ValueError(f"{name}: not a parameter of this model (get_weights() lists its names)")
        if not isinstance(value, (np.ndarray, jax.Array)):
            if not hasattr(value, "__array__"):
                raise ValueError(f"{name}: expected a jax or numpy array, got {type(value).__name__}")
            value = np.asarray(value)  # a torch CPU tensor, a list of floats...
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"{name}: dtype {value.dtype} is not a float dtype")
        if tuple(value.shape) != t.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)}, expected {t.shape} (Hugging Face's layout)")
        grouped.setdefault(t.leaf, Given(t.leaf, t.transpose, {})).arrays[t.layer] = value
    return grouped


def host_stack(given: Given, num_layers: int, dtype: jnp.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A leaf given whole as numpy, assembled on the host: (the engine's array in `dtype`, finite per
    layer [L] or [1]); placing it is then one device_put that sends each device its slice."""
    if None in given.arrays:
        parts = [given.arrays[None]]
    else:
        parts = [given.arrays[i] for i in range(num_layers)]
    host = np.stack([p.T if given.transpose else p for p in parts]).astype(np.dtype(dtype), copy=False)
    finite = np.isfinite(host.reshape(len(parts), -1)).all(axis=1)
    return (host[0] if None in given.arrays else host), finite


def assemble_fn(old: jax.Array | None, parts: tuple, *, layers: tuple[int, ...] | None, transpose: bool,
                dtype: jnp.dtype, top: bool):
    """The device form of host_stack, traced: `parts` (HF layout) transposed, stacked, cast, and set
    into `old` at `layers` when only some layers are given (None: the whole leaf; `top`: a top-level
    leaf, one part, not stacked). -> (the engine's array, finite per part [k])."""
    new = jnp.stack([p.T if transpose else p for p in parts]).astype(dtype)
    finite = jnp.all(jnp.isfinite(new.reshape(new.shape[0], -1)), axis=1)
    if top:
        return new[0], finite
    if layers is None:
        return new, finite
    return old.at[jnp.asarray(layers)].set(new), finite
