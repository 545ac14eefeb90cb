"""Quantized weights: one pytree type, one matmul, and the loaders that translate each format into it.

    qweight.py     QuantizedWeight (values + scales (+ zeros, perm, input scale) + static layout)
    matmul.py      matmul(x, w): the one entry the model calls (Pallas on GPU, XLA on CPU)
    calibrate.py   activation statistics through llama.forward (for SmoothQuant)
    quantize.py    quantize-on-load: int8 (SmoothQuant W8A8) and fp8, via qwix
    formats.py     `quantization_config` detection (vLLM's names) and `--quantization` checks
    hf_linear.py   AWQ / GPTQ / compressed-tensors / fp8 tensors -> QuantizedWeight, once at load
    sharding.py    tensor parallelism: each field's PartitionSpec (scales shard with their weights)
"""

from __future__ import annotations

import importlib

# Imported on first use, so `jaxserve.quantization.formats` (the list of methods) loads without JAX.
_LAZY = {"matmul": "matmul", "QuantizedWeight": "qweight", "dequantize": "qweight", "is_quantized": "qweight"}

__all__ = ["QuantizedWeight", "dequantize", "is_quantized", "matmul"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"jaxserve.quantization.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jaxserve.quantization' has no attribute {name!r}")
