"""The served weights under Hugging Face's parameter names, and new weights by those names into the
engine's param tree: the contract of `LLM.get_weights()` / `LLM.update_weights()` (engine/weight_sync.py).

    HF name                                    engine leaf              layout change
    model.embed_tokens.weight  [vocab, H]      embed                    none (the same array)
    model.norm.weight          [H]             final_norm               none (the same array)
    lm_head.weight             [vocab, H]      lm_head [H, vocab]       transposed (untied only)
    model.layers.{i}.<name>    [out, in]       layers/<leaf>[i] [in, out]  stacked on axis 0, Linear
                                                                        weights transposed

    model.layers.{i}.mlp.experts.{e}.gate_proj.weight  [I, H]   layers/we_gate[r, e]  (MoE: r the layer's
                                                    row among the MoE layers, layer_kinds; Mixtral's
                                                    block_sparse_moe.experts.{e}.w1/w3/w2)

The per-layer names are the loader's own map (registry `layer_tensors(cfg)`, the one assemble.py
reads checkpoints with), so a family's names are written once: a plain (name, transpose) pair, or a
reader carrying `hf_cuts` (models/tensor_cuts.py) for what is not one tensor per row: Phi-3's fused
qkv_proj / gate_up_proj (one name, three / two leaves' rows), the MoE experts (a row from E per-expert
tensors), gpt-oss's fused expert tensors (interleaved gate / up columns), DeepSeek's kv_b_proj
(W_UK / W_UV). A mixed model's dense and MoE leaves stack only their own kind's layers
(models/layer_kinds.py): row r of w_gate is the r-th dense layer. A reader that reads no tensor
(gpt-oss's `sliding` flag, a mixed MoE's `sparse` flag) comes from the config and has no name. Under
`--quantization int8` the engine holds wq|wk|wv as `wqkv` and w_gate|w_up as `w_gate_up`
(quantization/quantize.py): they are split back. MoE experts kept as bfloat16 bits (weights/
expert_bits.py) are widened on the way out and rounded to bfloat16 on the way in, as the engine
holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.expert_weights import BF16_BITS, widen
from jaxserve.models.layer_kinds import leaf_layers
from jaxserve.models.llama import param_shapes
from jaxserve.models.tensor_cuts import Cut
from jaxserve.quantization.qweight import QuantizedWeight

TOP_LEVEL = {"embed": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False),
             "lm_head": ("lm_head.weight", True)}
# --quantization int8's fused leaves -> the float leaves they hold, in column order
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
# per-output-channel schemes a served weight can be read back from (values * scales)
DEQUANTIZABLE = ("int8", "fp8")


@dataclass(frozen=True)
class Part:
    """One piece of an HF tensor in the engine's tree: layers/<leaf>[index] (index (row,) or (row,
    expert); () for a top-level leaf) is `cut` of the tensor."""
    leaf: str  # "embed", "final_norm", "lm_head", or a layer leaf ("wq", "we_gate", ...)
    index: tuple[int, ...]  # the leaf's row in its own stack (a kind's layers: layer_kinds), then the expert
    cut: Cut

    @property
    def path(self) -> str:
        """The engine leaf's path, as errors name it: layers/wq[3]."""
        return self.leaf if not self.index else f"layers/{self.leaf}{list(self.index)}"


@dataclass(frozen=True)
class HFTensor:
    """Where one HF tensor lives in the engine's tree: its parts (one for a plain weight; Phi-3's
    qkv_proj: wq, wk and wv's rows; gpt-oss's gate_up_proj: the gate and up stacks' interleaved columns)."""
    shape: tuple[int, ...]  # HF's shape
    parts: tuple[Part, ...]


def name_map(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Every HF parameter name the model has -> its place in the engine's float tree (param_shapes').
    ValueError naming the family and leaf for a reader with no per-name form (no `hf_cuts`)."""
    shapes = param_shapes(cfg)
    out = {}
    for k, (name, transpose) in TOP_LEVEL.items():
        if k in shapes:
            shape = tuple(shapes[k])[::-1] if transpose else tuple(shapes[k])
            out[name] = HFTensor(shape, (Part(k, (), Cut(name, shape, transpose=transpose)),))
    tensors = registry.get_family(cfg.architecture).layer_tensors(cfg)
    pieces: dict[str, list[Part]] = {}
    for leaf, shape in shapes["layers"].items():
        source = tensors[leaf]
        cuts = getattr(source, "hf_cuts", None)
        if callable(source) and cuts is None:
            if _reads_tensors(source):
                raise ValueError(f"{cfg.architecture}: the engine leaf layers/{leaf} has no Hugging Face name here "
                                 "(its reader has no hf_cuts); pass engine_params()' tree to update_weights instead")
            continue  # a flag from the config (sliding, sparse): not a weight
        if cuts is None:
            hf, transpose = source
            per_layer = tuple(shape[1:])[::-1] if transpose else tuple(shape[1:])
            cuts = lambda prefix, hf=hf, t=transpose, s=per_layer: (Cut(prefix + hf, s, transpose=t),)  # noqa: E731
        for row, layer in enumerate(leaf_layers(cfg, leaf)):
            for c in cuts(f"model.layers.{layer}."):
                index = (row,) if c.expert is None else (row, c.expert)
                pieces.setdefault(c.name, []).append(Part(leaf, index, c))
    for name, parts in pieces.items():
        out[name] = HFTensor(parts[0].cut.shape, tuple(parts))
    return out


def leaf_names(names: Mapping[str, HFTensor]) -> dict[tuple[str, tuple[int, ...]], str]:
    """(leaf, index) -> HF name: the inverse, to name a parameter in an error."""
    return {(p.leaf, p.index): n for n, t in names.items() for p in t.parts}


def _reads_tensors(reader) -> bool:
    """Whether a layer_tensors reader reads the checkpoint (a weight) or only the config (a flag)."""
    def absent(name: str):
        raise KeyError(name)
    try:
        reader(absent, "model.layers.0.")
    except KeyError:
        return True
    return False


def to_engine(x, cut: Cut, xp=jnp):
    """An HF tensor's piece in the engine's layout (`xp`: numpy on the host, jax.numpy traced)."""
    if cut.view is not None:
        x = x.reshape(cut.view)
    if not cut.whole:
        x = x[(slice(None),) * cut.axis + (slice(cut.start, cut.stop, cut.step),)]
    return xp.swapaxes(x, -1, -2) if cut.transpose else x


def from_engine(rows: list[jax.Array], t: HFTensor) -> jax.Array:
    """The HF tensor from its parts' rows (engine layout), traced: each row put back where its cut took it."""
    if len(t.parts) == 1 and t.parts[0].cut.whole:
        c = t.parts[0].cut
        return jnp.swapaxes(rows[0], -1, -2) if c.transpose else rows[0]
    c0 = t.parts[0].cut
    out = jnp.zeros(c0.view or t.shape, rows[0].dtype)
    for row, p in zip(rows, t.parts):
        c = p.cut
        out = out.at[(slice(None),) * c.axis + (slice(c.start, c.stop, c.step),)].set(
            jnp.swapaxes(row, -1, -2) if c.transpose else row)
    return out.reshape(t.shape)


def float_layers(layers: Mapping, cfg: ModelConfig, dtype: jnp.dtype) -> dict:
    """The layer leaves as float arrays in the unfused layout: quantized leaves (int8 / fp8, one
    scale per output channel) dequantized to `dtype`, wqkv / w_gate_up split, bfloat16-bit expert
    stacks widened. Traced inside a program (weight_sync's), so it costs one pass over each leaf."""
    out = {}
    for leaf, value in layers.items():
        if isinstance(value, QuantizedWeight):
            if value.scheme not in DEQUANTIZABLE:
                raise ValueError(f"get_weights: layers/{leaf} is a {value.scheme} checkpoint weight; only float, "
                                 f"int8 and fp8 (per channel) engines are read back by name")
            value = (value.values.astype(jnp.float32) * value.scales).astype(dtype)
        elif not isinstance(value, jax.Array):
            raise ValueError(f"get_weights: layers/{leaf} is held as {type(value).__name__} (a packed checkpoint "
                             "format, such as gpt-oss's mxfp4); only float weights are read back by name")
        elif value.dtype == BF16_BITS:
            value = widen(value).astype(dtype)
        if leaf in FUSED:
            nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            cuts = [nq, nq + nkv] if leaf == "wqkv" else [value.shape[-1] // 2]
            out.update(zip(FUSED[leaf], jnp.split(value, cuts, axis=-1)))
        else:
            out[leaf] = value
    return out


def to_hf(floats: Mapping, names: Mapping[str, HFTensor]) -> dict[str, jax.Array]:
    """{HF name: tensor} of the named layer parameters from the float leaves, traced (one program)."""
    return {n: from_engine([floats[p.leaf][p.index] for p in t.parts], t) for n, t in names.items()
            if t.parts[0].index}


@dataclass(frozen=True)
class Given:
    """The validated update of one engine leaf: its parts given, each with its HF array."""
    leaf: str
    parts: list[tuple[str, Part, object]]  # (HF name, part, numpy or jax array in HF's layout)

    @property
    def on_host(self) -> bool:
        return all(isinstance(a, np.ndarray) for _, _, a in self.parts)

    def covers(self, shape: tuple[int, ...]) -> bool:
        """Whether the parts fill the whole leaf of `shape` (every row, every expert)."""
        depth = len(self.parts[0][1].index)
        return len({p.index for _, p, _ in self.parts}) == int(np.prod(shape[:depth], dtype=np.int64))


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
        for p in t.parts:
            grouped.setdefault(p.leaf, Given(p.leaf, [])).parts.append((name, p, value))
    return grouped


def cast(x, dtype, xp=jnp):
    """`x` in the leaf's dtype; BF16_BITS: rounded to bfloat16 and kept as its bits (expert_bits)."""
    if np.dtype(dtype) == np.dtype(BF16_BITS):
        if xp is np:
            return x.astype(jnp.bfloat16).view(np.uint16)
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(dtype)


def host_leaf(given: Given, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, np.ndarray]:
    """A leaf given whole as numpy, assembled on the host: (the engine's array in `dtype`, finite per
    part); placing it is then one device_put that sends each device its slice."""
    host = np.empty(shape, np.dtype(dtype))
    finite = []
    for _, p, value in given.parts:
        row = to_engine(value, p.cut, np)
        finite.append(bool(np.isfinite(row).all()))
        host[p.index] = cast(row, dtype, np)
    return host, np.asarray(finite)


def assemble_fn(old: jax.Array | None, values: tuple, *, parts: tuple[Part, ...], shape: tuple[int, ...],
                dtype: jnp.dtype):
    """The device form of host_leaf, traced: each part cut from its HF array (`values`), cast, and set
    into `old` at its index (None: the parts fill the whole leaf). -> (the engine's array, finite per part)."""
    rows = [to_engine(v, p.cut) for v, p in zip(values, parts)]
    finite = jnp.stack([jnp.all(jnp.isfinite(r)) for r in rows])
    rows = [cast(r, dtype) for r in rows]
    if old is None:
        order = sorted(range(len(parts)), key=lambda i: parts[i].index)
        return jnp.stack([rows[i] for i in order]).reshape(shape), finite
    at = tuple(jnp.asarray(col) for col in zip(*(p.index for p in parts)))
    return old.at[at].set(jnp.stack(rows)), finite
