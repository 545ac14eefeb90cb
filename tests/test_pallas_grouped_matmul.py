"""grouped_matmul (MoE experts): the alignment table, the Pallas kernel in interpret mode against its
reference and against jax.lax.ragged_dot over a shape sweep (empty groups, all rows in one group,
padding rows), its input checks, and its lowering for cuda at Qwen3-30B-A3B's expert shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.grouped_matmul import align_block_size, grouped_matmul, grouped_matmul_reference


def test_align_block_size_gives_each_block_one_expert():
    expert, start, rows = (np.asarray(a) for a in align_block_size(jnp.asarray([3, 0, 17, 1], jnp.int32), 24, 16))
    assert len(expert) == 2 + 4
    np.testing.assert_array_equal(expert[:4], [0, 2, 2, 3])
    np.testing.assert_array_equal(start[:4], [0, 3, 19, 20])
    np.testing.assert_array_equal(rows, [3, 16, 1, 1, 0, 0])


def _case(rng, sizes, m, k, n, dtype):
    sizes = np.asarray(sizes, np.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), n, k)) * 0.1, dtype)  # [E, N, K]
    return lhs, rhs, jnp.asarray(sizes)


# (group sizes, M (>= their sum: the rest is padding), K, N, dtype)
SWEEP = [
    ([1, 0, 2, 0, 0, 1, 0, 4], 8, 64, 64, jnp.float32),  # decode: few tokens, empty groups
    ([0, 0, 40, 0], 40, 128, 32, jnp.float32),  # all rows in one group, several blocks
    ([5, 16, 0, 17, 3, 0], 48, 32, 128, jnp.float32),  # block boundaries, 7 padding rows
    ([0, 0, 0], 4, 64, 64, jnp.float32),  # no rows at all
    ([2, 9, 1, 4], 16, 64, 96, jnp.bfloat16),  # N a multiple of 32, not of 64
]


@pytest.mark.parametrize("sizes,m,k,n,dtype", SWEEP)
def test_kernel_matches_reference_and_ragged_dot(sizes, m, k, n, dtype):
    lhs, rhs, gs = _case(np.random.default_rng(m + k + n), sizes, m, k, n, dtype)
    got = grouped_matmul(lhs, rhs, gs, interpret=True)
    want = grouped_matmul_reference(lhs, rhs, gs)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    ragged = jax.lax.ragged_dot(lhs.astype(jnp.float32), jnp.swapaxes(rhs, 1, 2).astype(jnp.float32), gs,
                                precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(want, np.float32), np.asarray(ragged), rtol=tol, atol=tol)
    assert np.all(np.asarray(got, np.float32)[int(np.sum(sizes)):] == 0)


@pytest.mark.parametrize("layer", [0, 2])
def test_kernel_reads_one_layer_of_a_stack_in_place(layer):
    """rhs [L, E, N, K] and a traced layer: the layer's experts, as the [E, N, K] call on rhs[layer]."""
    rng = np.random.default_rng(layer)
    sizes = [3, 0, 9, 4]
    lhs = jnp.asarray(rng.standard_normal((20, 64)), jnp.float32)
    stack = jnp.asarray(rng.standard_normal((3, 4, 32, 64)) * 0.1, jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    run = jax.jit(lambda a, b, s, l: grouped_matmul(a, b, s, l, interpret=True))
    got = run(lhs, stack, gs, jnp.int32(layer))
    np.testing.assert_allclose(got, grouped_matmul(lhs, stack[layer], gs, interpret=True), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, grouped_matmul_reference(lhs, stack, gs, layer), rtol=1e-6, atol=1e-6)


def test_validation_errors():
    lhs, rhs, gs = _case(np.random.default_rng(0), [2, 2], 4, 64, 64, jnp.float32)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, gs[:1])
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="K=32"):
        grouped_matmul(lhs[:, :32], rhs, gs)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(lhs[:, :40], rhs[:, :, :40], gs)
    with pytest.raises(ValueError, match=r"\[L, E, N, K\]"):  # a layer needs the layer axis
        grouped_matmul(lhs, rhs, gs, 0)


@pytest.mark.parametrize("m,k,n", [(8 * 8, 2048, 1536), (64 * 8, 768, 2048)])  # top-8 of 128: gate_up, down
def test_kernel_lowers_to_triton(m, k, n):
    sds = jax.ShapeDtypeStruct
    exp = export.export(jax.jit(grouped_matmul), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
                        )(sds((m, k), jnp.bfloat16), sds((128, n, k), jnp.bfloat16), sds((128,), jnp.int32))
    assert "xla.gpu.triton" in exp.mlir_module()
    layered = export.export(jax.jit(grouped_matmul), platforms=["cuda"],  # 48 layers' stacks, one read
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
                            )(sds((m, k), jnp.bfloat16), sds((48, 128, n, k), jnp.bfloat16), sds((128,), jnp.int32),
                              sds((), jnp.int32))
    assert f"tensor<48x128x{n}x{k}xbf16>) ->" in layered.mlir_module()
