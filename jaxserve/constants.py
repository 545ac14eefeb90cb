"""The names a flag may take, defined once: engine args, the scheduler, the models and the CLI read them here.

Each set is a `Literal` type (what pydantic validates and `cli_args` turns into
`choices`) and its tuple of values. Imports no JAX, so reading the flags stays fast.
"""

from __future__ import annotations

from typing import Literal, get_args

PreemptionMode = Literal["recompute", "swap"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# "xla": the XLA attention path (the CPU serving path); "pallas": the Pallas kernels (GPU).
# "reference" is the old name of "xla", still accepted.
AttentionBackend = Literal["auto", "xla", "pallas", "reference"]
# The one list of --quantization methods (vLLM's names); jaxserve/quantization/formats.py, the CLI's
# choices, EngineArgs, the loader's checks, worker/sizing and `jaxserve plan` all read it.
QUANTIZATION_CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4")  # read from config.json
QUANTIZATION_ON_LOAD_METHODS = ("int8", "fp8")  # applied to a float checkpoint at load
QUANTIZATION_GGUF = "gguf"  # a .gguf file's quantized tensors kept as their blocks (quantization/gguf_packed.py)
Quantization = Literal[tuple(dict.fromkeys(QUANTIZATION_ON_LOAD_METHODS + QUANTIZATION_CHECKPOINT_METHODS
                                           + (QUANTIZATION_GGUF,)))]
KvCacheDtype = Literal["auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"]
BlockSize = Literal[8, 16, 32, 64, 128]

PREEMPTION_MODES: tuple[str, ...] = get_args(PreemptionMode)
DTYPES: tuple[str, ...] = get_args(Dtype)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
RESOLVED_BACKENDS = ("xla", "pallas")  # what `auto` and the alias resolve to
BACKEND_ALIASES = {"reference": "xla"}
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
BLOCK_SIZES: tuple[int, ...] = get_args(BlockSize)

CPU_MAX_MODEL_LEN = 2048  # default context cap on CPU, where long contexts are impractically slow


def resolve_attention_backend(name: str, platform: str) -> str:
    """`auto` picks the Pallas kernels on GPU and the XLA path elsewhere; `reference` means `xla`."""
    if name == "auto":
        return "pallas" if platform == "gpu" else "xla"
    name = BACKEND_ALIASES.get(name, name)
    if name not in RESOLVED_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    return name
