"""w4a16_matmul: the Pallas kernel (interpret mode) against its reference, its input checks, and
its lowering for cuda at Llama-3.1-8B's shapes; `quantization.matmul` picks the kernel on cuda
for decode sizes and the XLA dot otherwise, and lowers fp8 weights to an f8E4M3FN dot."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.quantization import QuantizedWeight, matmul
from jaxserve.quantization.qweight import dense_weight, pack_int
from pallas_kernels.w4a16_matmul import w4a16_matmul, w4a16_matmul_reference

TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
LLAMA_8B = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]  # (K, N): q/o, k/v, gate/up, down


def _weight(rng, k: int, n: int, group: int, dtype=np.float32) -> QuantizedWeight:
    return _weight_and_values(rng, k, n, group, dtype)[0]


def _weight_and_values(rng, k: int, n: int, group: int, dtype=np.float32) -> tuple[QuantizedWeight, np.ndarray]:
    """The packed weight and, in numpy from its integers, the float weight [K, N] it stands for:
    (q - zero) * scale per group of `group` rows (GPTQ's convention), the scales as stored in `dtype`."""
    q = rng.integers(0, 16, (k, n))
    scales = (rng.random((k // group, n)) * 0.02 + 0.001).astype(np.float32)
    zeros = rng.integers(0, 16, (k // group, n))
    stored = scales.astype(np.dtype(dtype)).astype(np.float64)
    values = (q - np.repeat(zeros, group, axis=0)) * np.repeat(stored, group, axis=0)
    return jax.tree.map(jnp.asarray, pack_int(q, scales, zeros, None, 4, dtype)), values


@pytest.mark.parametrize("m,k,n,group,dtype", [
    (1, 256, 128, 64, jnp.float32), (5, 256, 64, 32, jnp.float32), (16, 512, 128, 128, jnp.float32),
    (64, 256, 192, 64, jnp.float32), (7, 256, 128, 128, jnp.bfloat16),
])
def test_kernel_matches_reference(m, k, n, group, dtype):
    rng = np.random.default_rng(m + k + n)
    w, values = _weight_and_values(rng, k, n, group, dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = w4a16_matmul(x, w.values, w.scales, w.zeros, group_size=group, interpret=True)
    want = w4a16_matmul_reference(x, w.values, w.scales, w.zeros, group_size=group)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                               atol=tol * float(jnp.abs(want.astype(jnp.float32)).max()))
    # Both are the product with the weight the integers stand for (numpy, not the layout's own inverse).
    dense = np.asarray(x, np.float64) @ values
    np.testing.assert_array_equal(dense_weight(w), values.astype(np.float32))
    for out in (got, want):
        np.testing.assert_allclose(np.asarray(out, np.float32), dense, rtol=tol, atol=tol * np.abs(dense).max())


def test_kernel_rejects_bad_inputs():
    rng = np.random.default_rng(0)
    w = _weight(rng, 256, 128, 64)
    x = jnp.ones((4, 256))
    with pytest.raises(ValueError, match="rows"):
        w4a16_matmul(jnp.ones((65, 256)), w.values, w.scales, w.zeros, group_size=64, interpret=True)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, w.values, w.scales, w.zeros, group_size=48, interpret=True)
    with pytest.raises(ValueError, match="packed"):
        w4a16_matmul(jnp.ones((4, 128)), w.values, w.scales, w.zeros, group_size=64, interpret=True)
    with pytest.raises(ValueError, match="uint8"):
        w4a16_matmul(x, w.values.astype(jnp.int32), w.scales, w.zeros, group_size=64, interpret=True)


@pytest.mark.parametrize("k,n", LLAMA_8B)
def test_kernel_lowers_to_triton_at_llama_8b_shapes(k, n):
    sds = jax.ShapeDtypeStruct
    fn = jax.jit(functools.partial(w4a16_matmul, group_size=128))
    exp = export.export(fn, platforms=["cuda"], disabled_checks=[TRITON])(
        sds((16, k), jnp.bfloat16), sds((k // 2, n), jnp.uint8), sds((k // 128, n), jnp.bfloat16),
        sds((k // 128, n), jnp.uint8))
    assert "xla.gpu.triton" in exp.mlir_module()


def _export_matmul(x, w) -> str:
    return export.export(jax.jit(matmul), platforms=["cuda"], disabled_checks=[TRITON])(x, w).mlir_module()


@pytest.mark.parametrize("rows,want_kernel", [(1, True), (64, True), (65, False), (512, False)])
def test_matmul_picks_the_kernel_for_decode_sizes_on_cuda(rows, want_kernel):
    k, n = 4096, 14336
    sds = jax.ShapeDtypeStruct
    w = QuantizedWeight(sds((k // 2, n), jnp.uint8), sds((k // 128, n), jnp.bfloat16), sds((k // 128, n), jnp.uint8),
                        scheme="w4a16", group_size=128)
    assert ("xla.gpu.triton" in _export_matmul(sds((rows, k), jnp.bfloat16), w)) == want_kernel


def test_matmul_runs_xla_on_cpu_and_matches_the_kernel_reference():
    rng = np.random.default_rng(3)
    w = _weight(rng, 256, 128, 64)
    x = jnp.asarray(rng.standard_normal((3, 2, 256)), jnp.float32)
    got = jax.jit(matmul)(x, w)
    want = w4a16_matmul_reference(x.reshape(6, 256), w.values, w.scales, w.zeros, group_size=64)
    np.testing.assert_allclose(np.asarray(got).reshape(6, -1), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("static", [False, True])
def test_fp8_matmul_lowers_to_an_fp8_dot_on_cuda(static):
    sds = jax.ShapeDtypeStruct
    w = QuantizedWeight(sds((4096, 14336), jnp.float8_e4m3fn), sds((1, 14336), jnp.float32),
                        input_scale=sds((), jnp.float32) if static else None, scheme="fp8")
    module = _export_matmul(sds((64, 4096), jnp.bfloat16), w)
    dots = [line for line in module.splitlines() if "stablehlo.dot_general" in line]
    assert dots and all("f8E4M3FN" in line for line in dots), dots
