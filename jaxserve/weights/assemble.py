"""Turn per-tensor weights named as transformers names them into jaxserve's stacked params."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.models import llama, registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.expert_weights import BF16_BITS, EXPERT_STACKS, host_bf16_bits
from jaxserve.models.layer_kinds import leaf_layers
from jaxserve.models.llama import Params, param_shapes
from jaxserve.quantization.hf_linear import LinearReader
from jaxserve.quantization.mxfp4 import Mxfp4Weight
from jaxserve.quantization.qweight import stack

# The dense Llama family's names (our layer leaf -> (name under model.layers.{i}., transpose?));
# every family's own map is registry.get_family(arch).layer_tensors(cfg).
LAYER_TENSORS: dict[str, tuple[str, bool]] = llama.LAYER_TENSORS

TensorGetter = Callable[[str], np.ndarray]  # raises KeyError when the tensor is absent


# (leaf path such as "embed" or "layers/wq", host array, dtype) -> device array; see jaxserve.parallel.place_fn
PlaceFn = Callable[[str, np.ndarray, jnp.dtype], jax.Array]


def assemble_params(cfg: ModelConfig, get: TensorGetter, dtype: jnp.dtype, source: str,
                    progress: bool = True, place_leaf: PlaceFn | None = None,
                    linear: LinearReader | None = None, expert_bits: bool = False) -> Params:
    """Read every tensor through `get`, check its shape, stack the layers and place them on device.

    `place_leaf` puts each stacked leaf on device; the default copies it whole to the
    default device, `jaxserve.parallel.place_fn(mesh, cfg)` sends each device only its slice.
    `linear` (a quantized checkpoint) reads each layer's projections as QuantizedWeights (None for
    a leaf it leaves float); one with `reads_head` set (--quantization gguf) reads the embedding and
    the untied LM head too, and a tied head is then the embedding's own quantized weight.
    `expert_bits` (float32 weights on one device): MoE expert stacks stored in bfloat16 are kept as
    their bits (expert_weights.BF16_BITS), read layer by layer into the stack: never float32.
    """
    shapes = param_shapes(cfg)
    total = 2 + (0 if cfg.tie_word_embeddings else 1) + len(shapes["layers"])
    bar = tqdm(total=total, desc=f"Loading {source}", unit="tensor", disable=not progress)

    def fetch(name: str, transpose: bool, expected: tuple[int, ...]) -> np.ndarray:
        """One tensor, checked against its expected shape (as the model consumes it) before any stacking."""
        try:
            arr = np.asarray(get(name))
        except KeyError:
            raise ValueError(f"{source}: missing tensor {name!r}") from None
        stored = expected[::-1] if transpose else expected  # transformers stores Linear weights [out, in]
        if arr.shape != stored:
            raise ValueError(f"{source}: tensor {name!r} has shape {arr.shape}, expected {stored}")
        return arr.T if transpose else arr

    def place(arr: np.ndarray, expected: tuple[int, ...], name: str, leaf: str) -> jax.Array:
        if arr.shape != expected:
            raise ValueError(f"{source}: tensor {name!r} has shape {arr.shape}, expected {expected}")
        bar.update(1)
        arr = arr.astype(np.float32) if arr.dtype != np.float32 else arr
        return jnp.asarray(arr, dtype=dtype) if place_leaf is None else place_leaf(leaf, arr, dtype)

    # A reader with `reads_head` (--quantization gguf) may keep the embedding and the LM head quantized.
    packed = getattr(linear, "reads_head", False)
    embed = linear("model.embed_tokens", shapes["embed"]) if packed else None
    params: Params = {"embed": jax.tree.map(jnp.asarray, embed) if embed is not None else place(
        fetch("model.embed_tokens.weight", False, shapes["embed"]), shapes["embed"], "model.embed_tokens.weight",
        "embed")}
    if embed is not None:
        bar.update(1)
    layers = {}
    tensors = registry.get_family(cfg.architecture).layer_tensors(cfg)
    for leaf, expected in shapes["layers"].items():
        ids = leaf_layers(cfg, leaf)  # a mixed MoE's dense / expert leaves: their own kind's layers only
        if callable(tensors[leaf]) and linear is not None and getattr(tensors[leaf], "takes_linear", False):
            per_layer = [_read_quantized(tensors[leaf], get, i, expected[1:], source, linear) for i in ids]
            if isinstance(per_layer[0], np.ndarray):  # float (DeepSeek's kv_b_proj as W_UK / W_UV): the model dtype
                layers[leaf] = place(np.stack(per_layer), expected, f"model.layers.*.{leaf}", f"layers/{leaf}")
                continue
            layers[leaf] = jax.tree.map(jnp.asarray, stack(per_layer))  # a quantized checkpoint's expert stacks
            bar.update(1)
            continue
        if callable(tensors[leaf]):  # a family's reader (experts stacked, a mixed model's zeros)
            first = _read(tensors[leaf], get, ids[0], expected[1:], source)
            bits = (_bits_stack(tensors[leaf], get, first, expected, source, ids) if expert_bits and leaf in EXPERT_STACKS
                    and place_leaf is None and isinstance(first, np.ndarray) else None)
            if bits is not None:
                layers[leaf] = jnp.asarray(bits)
                bar.update(1)
                continue
            per_layer = [first] + [_read(tensors[leaf], get, i, expected[1:], source) for i in ids[1:]]
            if isinstance(per_layer[0], Mxfp4Weight):  # packed experts (gpt-oss's mxfp4): stay packed
                layers[leaf] = jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *per_layer)
                bar.update(1)
                continue
            layers[leaf] = place(np.stack(per_layer), expected, f"model.layers.*.{leaf}", f"layers/{leaf}")
            continue
        hf_name, transpose = tensors[leaf]
        if linear is not None and hf_name.endswith("_proj.weight"):
            prefix = hf_name.removesuffix(".weight")
            per_layer = [linear(f"model.layers.{i}.{prefix}", expected[1:]) for i in ids]
            if per_layer[0] is not None:  # None: the reader keeps this leaf float (a GGUF's other types)
                layers[leaf] = jax.tree.map(jnp.asarray, stack(per_layer))
                bar.update(1)
                continue
        stacked = np.stack([fetch(f"model.layers.{i}.{hf_name}", transpose, expected[1:]) for i in ids])
        layers[leaf] = place(stacked, expected, f"model.layers.*.{hf_name}", f"layers/{leaf}")
    if linear is not None:
        layers.update(_kv_scales(get, cfg.num_layers))
    params["layers"] = layers
    params["final_norm"] = place(fetch("model.norm.weight", False, shapes["final_norm"]), shapes["final_norm"],
                                 "model.norm.weight", "final_norm")
    head = linear("lm_head", shapes["lm_head"]) if packed and not cfg.tie_word_embeddings else None
    if head is not None:
        params["lm_head"] = jax.tree.map(jnp.asarray, head)
        bar.update(1)
    elif packed and cfg.tie_word_embeddings and embed is not None:  # tied: the head is the embedding's blocks
        params["lm_head"] = params["embed"].w
    elif not cfg.tie_word_embeddings:
        params["lm_head"] = place(fetch("lm_head.weight", True, shapes["lm_head"]), shapes["lm_head"],
                                  "lm_head.weight", "lm_head")
    bar.close()
    return params


def _read(reader: Callable, get: TensorGetter, layer: int, expected: tuple[int, ...],
          source: str) -> np.ndarray | Mxfp4Weight:
    """One layer's leaf through a family's reader (a host array, or packed Mxfp4 experts), checked
    against its expected (logical) shape."""
    try:
        out = reader(get, f"model.layers.{layer}.")
        arr = out if isinstance(out, Mxfp4Weight) else np.asarray(out)
    except KeyError as e:
        raise ValueError(f"{source}: missing tensor {e.args[0]!r}") from None
    if arr.shape != expected:
        raise ValueError(f"{source}: layer {layer}: tensor of shape {arr.shape}, expected {expected}")
    return arr


def _bits_stack(reader: Callable, get: TensorGetter, first: np.ndarray, expected: tuple[int, ...],
                source: str, ids: tuple[int, ...]) -> np.ndarray | None:
    """The [len(ids), ...] stack of a leaf's bfloat16 bits, read layer by layer (`first`: layer ids[0]'s
    array), or None where a layer holds values bfloat16 cannot (then it loads as float32)."""
    out = np.empty(expected, BF16_BITS)
    for row, i in enumerate(ids):
        b = host_bf16_bits(first if row == 0 else _read(reader, get, i, expected[1:], source))
        if b is None:
            return None
        out[row] = b
    return out


def _read_quantized(reader: Callable, get: TensorGetter, layer: int, expected: tuple[int, ...], source: str,
                    linear: LinearReader):
    """One layer's leaf as a host QuantizedWeight through a family's reader, shape-checked."""
    try:
        w = reader(get, f"model.layers.{layer}.", linear)
    except KeyError as e:
        raise ValueError(f"{source}: missing tensor {e.args[0]!r}") from None
    if tuple(w.shape) != tuple(expected):
        raise ValueError(f"{source}: layer {layer}: quantized weight of shape {w.shape}, expected {expected}")
    return w


def _kv_scales(get: TensorGetter, num_layers: int) -> dict[str, jax.Array]:
    """A quantized checkpoint's per-layer KV cache scales (vLLM's self_attn.k_scale / v_scale), if any."""
    out = {}
    for leaf in ("k_scale", "v_scale"):
        try:
            vals = [np.asarray(get(f"model.layers.{i}.self_attn.{leaf}"), np.float32).reshape(-1).max()
                    for i in range(num_layers)]
        except KeyError:
            return {}
        out[leaf] = jnp.asarray(np.stack(vals))
    return out
