"""lora_shrink_expand: the Pallas kernel (interpret mode) and its reference (the engine's XLA one-hot
path) against a numpy loop over the tokens (each its own slot's A and B) at decode sizes and SmolLM2's projection shapes, its input checks, and its lowering
for NVIDIA GPUs (Triton) from this CPU machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.lora import layers
from pallas_kernels.lora_shrink_expand import lora_shrink_expand, lora_shrink_expand_reference

TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def _inputs(m: int, k: int, n: int, num_slots: int, rank: int, dtype=np.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    slots = jnp.asarray(rng.integers(0, num_slots + 1, m), jnp.int32)
    a = jnp.asarray(rng.standard_normal((k, num_slots * rank)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal((num_slots * rank, n)), dtype)
    return x, slots, a, b


def _numpy_delta(x, slots, a, b, rank: int) -> np.ndarray:
    """Token t of slot s > 0: x[t] @ A_s @ B_s, A_s / B_s slot s's `rank` columns of a / rows of b; 0 for slot 0."""
    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    out = np.zeros((x.shape[0], b.shape[1]))
    for t, s in enumerate(np.asarray(slots)):
        if s:
            cols = slice((s - 1) * rank, s * rank)
            out[t] = x[t] @ a[:, cols] @ b[cols]
    return out


@pytest.mark.parametrize("m,k,n,num_slots,rank", [(1, 576, 576, 1, 8), (16, 576, 192, 4, 16),
                                                   (64, 1536, 576, 8, 8), (5, 64, 1536, 3, 32)])
def test_kernel_matches_reference(m, k, n, num_slots, rank):
    x, slots, a, b = _inputs(m, k, n, num_slots, rank)
    got = np.asarray(lora_shrink_expand(x, slots, a, b, rank=rank, interpret=True))
    want = _numpy_delta(x, slots, a, b, rank)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[np.asarray(slots) == 0].any()  # the base model's rows: exactly zero
    np.testing.assert_allclose(np.asarray(lora_shrink_expand_reference(x, slots, a, b, rank=rank)), want,
                               rtol=1e-5, atol=1e-5)
    # the engine's XLA path (the one-hot product) too
    owner = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank + 1
    np.testing.assert_allclose(np.asarray(layers.delta(x, {"a": a, "b": b}, layers.slot_mask(slots, owner))),
                               want, rtol=1e-5, atol=1e-5)


def test_kernel_bfloat16():
    x, slots, a, b = _inputs(8, 128, 64, 2, 16, np.float32, seed=1)
    x, a, b = (t.astype(jnp.bfloat16) for t in (x, a, b))
    got = lora_shrink_expand(x, slots, a, b, rank=16, interpret=True)
    want = lora_shrink_expand_reference(x, slots, a, b, rank=16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("change,match", [
    (dict(m=65), "rows"), (dict(k=100), "K=100"), (dict(rank=12), "power-of-two"),
])
def test_input_checks(change, match):
    args = dict(m=4, k=128, n=64, num_slots=2, rank=8) | change
    x, slots, a, b = _inputs(**args)
    with pytest.raises(ValueError, match=match):
        lora_shrink_expand(x, slots, a, b, rank=args["rank"], interpret=True)


@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (16, 576, 192), (64, 1536, 576)])
def test_lowers_for_cuda(m, k, n):
    shapes = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((m,), jnp.int32),
              jax.ShapeDtypeStruct((k, 8 * 16), jnp.bfloat16), jax.ShapeDtypeStruct((8 * 16, n), jnp.bfloat16))
    fn = jax.jit(lambda x, s, a, b: lora_shrink_expand(x, s, a, b, rank=16))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[TRITON])(*shapes).mlir_module()
    assert text.count("@__gpu$xla.gpu.triton(") == 2  # the shrink, then the expand
    assert '"lora_shrink"' in text and '"lora_expand"' in text
