"""Load an HF-format model directory: config.json plus *.safetensors, with or without an index."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import Params
from jaxserve.models.moe_layers import check_quantization
from jaxserve.quantization.formats import QuantSpec, detect
from jaxserve.quantization.hf_linear import linear_reader
from jaxserve.weights.assemble import PlaceFn, assemble_params


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected an HF-format model directory)")
    cfg = ModelConfig.from_hf(_read_json(path), source=str(path))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = _read_json(gen).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (eos,)
            cfg = ModelConfig.from_dict({**cfg.to_dict(),
                                         "eos_token_ids": tuple(dict.fromkeys(cfg.eos_token_ids + extra))})
    return cfg


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no \"weight_map\" object (not a safetensors index)")
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    out: dict[str, Path] = {}
    for f in files:
        with _open(f) as st:
            out.update({name: f for name in st.keys()})
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_fp8(path: Path, name: str) -> np.ndarray:
    """One F8_E4M3 / F8_E5M2 tensor read straight from the file (8-byte header size, JSON header, data)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        entry = json.loads(fh.read(size))[name]
    dtype = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
             "F8_E8M0": ml_dtypes.float8_e8m0fnu}.get(entry["dtype"])  # E8M0: ue8m0 fp8 block scales
    if dtype is None:
        raise ValueError(f"{path}: cannot read tensor {name!r} of dtype {entry['dtype']}")
    start, end = entry["data_offsets"]
    data = np.fromfile(path, np.uint8, count=end - start, offset=8 + size + start)
    return data.view(dtype).reshape(entry["shape"])


def _open(path: Path):
    try:
        # framework="flax" reads bfloat16 too (numpy has no bfloat16 of its own).
        return safe_open(str(path), framework="flax")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"{path}: cannot read safetensors file ({e})") from None


def read_quantization(model_dir: Path, requested: str | None) -> QuantSpec | None:
    """The checkpoint's quantization (config.json's quantization_config), checked against `requested`."""
    return detect(_read_json(model_dir / "config.json"), requested)


def tensor_reader(model_dir: Path):
    """(get, names) over the directory's safetensors files: `get(name)` reads one tensor onto this
    process's host CPU device (KeyError for a name no file holds). A bare model saved without the
    `model.` prefix (sentence-transformers' decoder embedders) answers the prefixed names too.
    The one safetensors reader of the project: the loaders of every kind read through it."""
    files = _tensor_files(model_dir)
    handles: dict[Path, object] = {}

    def get(name: str):
        if name not in files and name.startswith("model.") and name[len("model."):] in files:
            name = name[len("model."):]
        if name not in files:
            raise KeyError(name)
        f = files[name]
        if f not in handles:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: listed in the index but missing")
            handles[f] = _open(f)
        try:
            # Read onto the host CPU device: no accelerator ever holds a whole weight when
            # `place_leaf` sends each one straight to its tensor-parallel shards.
            with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's (multi-host)
                return handles[f].get_tensor(name)
        except AttributeError:  # safetensors' flax reader names numpy fp8 dtypes numpy lacks
            return _read_fp8(f, name)
        except Exception as e:
            raise ValueError(f"{f}: cannot read tensor {name!r} ({e})") from None

    return get, frozenset(files)


def load_safetensors_dir(model_dir: Path, cfg: ModelConfig, dtype: jnp.dtype, progress: bool = True,
                         place_leaf: PlaceFn | None = None, quant: QuantSpec | None = None,
                         expert_bits: bool = False) -> Params:
    if quant is not None:  # before any tensor is read
        check_quantization(cfg, quant.method, quant.scheme)
    get, _ = tensor_reader(model_dir)
    if cfg.vision is not None:  # a vision-language model: its language model, then its tower (models/qwen2_vl.py)
        from jaxserve.models import qwen2_vl

        get = qwen2_vl.tensor_getter(get)
    # mxfp4 (gpt-oss) quantizes MoE experts only: the Linears read here are float.
    linear = None if quant is None or quant.scheme == "mxfp4" else linear_reader(quant, get, dtype)
    params = assemble_params(cfg, get, dtype, str(model_dir), progress, place_leaf, linear, expert_bits)
    return params if cfg.vision is None else {**params, "vision": qwen2_vl.load_vision(cfg, get, dtype)}
