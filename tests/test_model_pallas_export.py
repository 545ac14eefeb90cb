"""The model with the Pallas attention backend lowers for NVIDIA GPUs (Triton) from this CPU machine.

This catches lowering errors of the kernels as the model calls them (stacked 5-D cache and a
traced layer index inside lax.scan, GQA group padding) without a GPU; it does not run them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.worker.input_batch import StepInput, pack
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.models import llama
from jaxserve.quantization import quantize as quant
from jaxserve.models.attention import kv_pool_dtype
from jaxserve.models.config import ModelConfig

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=576, intermediate_size=256,
                  num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64)  # SmolLM2's attention shapes


@pytest.mark.parametrize("dtype,kv_cache_dtype,quantization", [
    (jnp.bfloat16, "auto", None), (jnp.float32, "auto", None), (jnp.bfloat16, "auto", "int8"),
    (jnp.float32, "bfloat16", "int8"),  # float32 queries against a bfloat16 pool
    (jnp.bfloat16, "fp8", "fp8"),  # fp8 weights and an fp8 pool
])
def test_model_step_with_pallas_backend_lowers_for_cuda(dtype, kv_cache_dtype, quantization):
    shapes = llama.param_shapes(CFG)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=lambda x: isinstance(x, tuple))
    if quantization:  # the quantized layout, from small random weights (calibration runs the model)
        rng = np.random.default_rng(0)
        real = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.05, dtype), params)
        quantized = quant.quantize_params(real, CFG, quantization, np.arange(32, dtype=np.int32))
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), quantized)
    num_blocks, block_size, max_len = 64, 16, 256
    kv_dtype = kv_pool_dtype(kv_cache_dtype, dtype, "pallas")  # bfloat16 itself, not its bits, on the GPU path
    kv = tuple(jax.ShapeDtypeStruct((CFG.num_layers, CFG.num_kv_heads, num_blocks, block_size, CFG.head_dim),
                                    kv_dtype) for _ in range(2))
    out = SchedulerOutput([ScheduledRequest("a", [1] * 20, 0, [3, 4], True),
                           ScheduledRequest("b", [2], 40, [5, 6, 7], True)], 21)
    batch, _ = pack(out, 32, 8, max_len // block_size, block_size)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.asarray(a).shape, np.asarray(a).dtype), batch)

    def step(params, kv, b: StepInput):
        return llama.forward(params, CFG, kv, b.token_ids, b.positions, b.attn, backend="pallas")

    exp = export.export(jax.jit(step), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(params, kv, batch)
    assert "xla.gpu.triton" in exp.mlir_module()
    if quantization == "int8":  # the matmuls really are int8 x int8 -> int32
        assert "tensor<576x960xi8>" in exp.mlir_module() and "-> tensor<32x960xi32>" in exp.mlir_module()
    if quantization == "fp8":  # f8 x f8 dots, and an f8 pool
        assert "tensor<32x576xf8E4M3FN>, tensor<576x576xf8E4M3FN>) -> tensor<32x576xf32>" in exp.mlir_module()
        assert "tensor<2x3x64x16x64xf8E4M3FN>" in exp.mlir_module()
