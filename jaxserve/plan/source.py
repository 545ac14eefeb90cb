"""Where `jaxserve plan` reads a model's config from, reading no weights.

In order: a local path (an HF directory's config.json, or a GGUF file's header), the installed
default model (no MODEL), a hub id already in the local Hugging Face cache, or one of the configs
bundled in jaxserve/plan/configs/ (hub id with "/" written "--"). Never the network.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from jaxserve.models.config import ModelConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    quantization: str | None  # the checkpoint's quant_method (awq, gptq, fp8, ...), None for float
    torch_dtype: str | None  # the checkpoint's float dtype, when config.json says
    where: str  # what was read, for the report


def bundled_ids() -> list[str]:
    files = resources.files("jaxserve.plan").joinpath("configs").iterdir()
    return sorted(f.name[: -len(".json")].replace("--", "/") for f in files if f.name.endswith(".json"))


def _from_hf_json(hf: dict, where: str) -> ModelSource:
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    return ModelSource(ModelConfig.from_hf(hf, source=where), quant, hf.get("torch_dtype") or hf.get("dtype"), where)


def _bundled(model: str) -> ModelSource | None:
    name = model.replace("/", "--") + ".json"
    path = resources.files("jaxserve.plan").joinpath("configs", name)
    if not path.is_file():
        return None
    return _from_hf_json(json.loads(path.read_text()), f"bundled config {model}")


def _hub_cache(model: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(model, "config.json")
    return Path(found) if isinstance(found, str) else None


def read_model(model: str | None) -> ModelSource:
    """The config of `model`; FileNotFoundError naming what was tried."""
    if model in (None, DEFAULT_MODEL, DEFAULT_HUB_ID):
        try:
            from jaxserve.weights.loader import default_model_path

            return _from_gguf(default_model_path())
        except FileNotFoundError:
            return _bundled(DEFAULT_HUB_ID)  # type: ignore[return-value]
    path = Path(os.path.expanduser(model))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: {path} is a file but not a .gguf; pass an HF directory or a GGUF file")
        return _from_gguf(path)
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"model: {path} has no config.json")
        return _from_hf_json(json.loads(cfg_path.read_text()), str(cfg_path))
    cached = _hub_cache(model) if model.count("/") == 1 else None
    if cached is not None:
        return _from_hf_json(json.loads(cached.read_text()), f"{cached} (local HF cache)")
    bundled = _bundled(model)
    if bundled is not None:
        return bundled
    raise FileNotFoundError(f"model: {model!r} is not a local path, not in the local Hugging Face cache and "
                            f"not bundled (bundled: {', '.join(bundled_ids())}); plan never downloads")


def _from_gguf(path: Path) -> ModelSource:
    from jaxserve.weights.gguf_file import read_header

    header, _ = read_header(path)
    # The engine dequantizes GGUF weights to its float dtype: a float checkpoint for sizing.
    return ModelSource(header.config, None, None, f"{path} (GGUF header)")
