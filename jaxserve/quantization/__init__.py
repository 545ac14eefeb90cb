"""Quantized weights: one pytree type, one matmul, and the loaders that translate each format into it.

    qweight.py     QuantizedWeight (values + scales (+ zeros, perm, input scale) + static layout)
    matmul.py      matmul(x, w): the one entry the model calls (Pallas on GPU, XLA on CPU)
    calibrate.py   activation statistics through llama.forward (for SmoothQuant)
    quantize.py    quantize-on-load: int8 (SmoothQuant W8A8) and fp8, via qwix
    formats.py     `quantization_config` detection (vLLM's names) and `--quantization` checks
    hf_linear.py   AWQ / GPTQ / compressed-tensors / fp8 tensors -> QuantizedWeight, once at load
    sharding.py    tensor parallelism: each field's PartitionSpec (scales shard with their weights)
"""

from jaxserve.quantization.matmul import matmul
from jaxserve.quantization.qweight import QuantizedWeight, dequantize, is_quantized

__all__ = ["QuantizedWeight", "dequantize", "is_quantized", "matmul"]
