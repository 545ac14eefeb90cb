"""Load a BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa; a pooling model's encoder) from an HF
directory, through the project's one safetensors reader (safetensors_dir.tensor_reader).

    config.json --EncoderConfig.from_hf--> cfg;  *.safetensors --tensor_reader--> params (models/bert.py's
    layout: [in, out] weights, every layer leaf stacked on [L]), each leaf placed as `place_leaf` says
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import bert
from jaxserve.weights.safetensors_dir import tensor_reader

PlaceLeaf = Callable[[str, np.ndarray], jax.Array]  # (leaf path "layers/wq", host array) -> device array


@dataclass
class LoadedEncoder:
    config: bert.EncoderConfig
    params: bert.Params
    name: str
    path: Path


def load_encoder(model_dir: Path, name: str, dtype: jnp.dtype, place_leaf: PlaceLeaf | None = None) -> LoadedEncoder:
    """The encoder's params in `dtype`; `place_leaf` puts each leaf on its devices (tensor parallel),
    one device (the default one) when None."""
    hf = json.loads((model_dir / "config.json").read_text())
    cfg = bert.EncoderConfig.from_hf(hf, str(model_dir / "config.json"))
    get, names = tensor_reader(model_dir)
    suffix = bert.EMBED_TENSORS["word_embed"]
    prefix = next((n.removesuffix(suffix) for n in names if n.endswith(suffix)), None)
    if prefix is None:
        raise ValueError(f"{model_dir}: no tensor named *{suffix}")

    def read(name: str, transpose: bool = False) -> np.ndarray:
        try:
            arr = np.asarray(get(name), np.float32)
        except KeyError:
            raise ValueError(f"{model_dir}: missing tensor {name!r}") from None
        return arr.T if transpose else arr

    def place(path: str, arr: np.ndarray) -> jax.Array:
        arr = arr.astype(jnp.dtype(dtype))
        return place_leaf(path, arr) if place_leaf is not None else jnp.asarray(arr)

    params: dict = {leaf: place(leaf, read(prefix + name)) for leaf, name in bert.EMBED_TENSORS.items()}
    params["layers"] = {leaf: place(f"layers/{leaf}", np.stack([read(f"{prefix}encoder.layer.{i}.{name}", t)
                                                                 for i in range(cfg.num_layers)]))
                        for leaf, (name, t) in bert.LAYER_TENSORS.items()}
    if cfg.num_labels:
        params["head"] = {leaf: place(f"head/{leaf}", read(name.format(p=prefix), t))
                          for leaf, (name, t) in bert.HEAD_TENSORS[cfg.family].items()}
    return LoadedEncoder(cfg, params, name, model_dir)
