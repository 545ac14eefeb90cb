"""write_kv: reference and Pallas kernel (interpret mode) vs numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import BF16_BITS, to_float32
from pallas_kernels.write_kv import write_kv, write_kv_reference


def numpy_write(k_cache, k_new, slots):
    out = k_cache.copy()
    block_size = k_cache.shape[2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[:, slot // block_size, slot % block_size] = k_new[t]
    return out


def make(rng, num_kv_heads=2, num_blocks=6, block_size=8, head_dim=64, num_tokens=11,
         dtype=np.float32):
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = rng.standard_normal(shape).astype(dtype)
    v_cache = rng.standard_normal(shape).astype(dtype)
    k_new = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype)
    v_new = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    slots[rng.random(num_tokens) < 0.3] = -1  # padding
    slots[0] = num_blocks * block_size - 1  # last slot of the pool
    return k_cache, v_cache, k_new, v_new, slots


@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,dtype", [
    (8, 64, 2, np.float32), (16, 128, 1, np.float32), (32, 64, 3, jnp.bfloat16),
])
def test_reference_matches_numpy(block_size, head_dim, num_kv_heads, dtype):
    k, v, kn, vn, slots = make(np.random.default_rng(0), num_kv_heads, 6, block_size,
                               head_dim, dtype=dtype)
    ko, vo = write_kv_reference(*map(jnp.asarray, (k, v, kn, vn, slots)))
    np.testing.assert_array_equal(np.asarray(ko), numpy_write(k, kn, slots))
    np.testing.assert_array_equal(np.asarray(vo), numpy_write(v, vn, slots))


def test_reference_writes_bfloat16_bits():
    # A uint16 pool holds bfloat16 bits: float32 rows are rounded to bfloat16 and stored as bits.
    k, v, kn, vn, slots = make(np.random.default_rng(3))
    bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), BF16_BITS))  # noqa: E731
    ko, vo = write_kv_reference(jnp.asarray(bits(k)), jnp.asarray(bits(v)), jnp.asarray(kn), jnp.asarray(vn),
                                jnp.asarray(slots))
    assert ko.dtype == BF16_BITS and vo.dtype == BF16_BITS
    np.testing.assert_array_equal(np.asarray(ko), numpy_write(bits(k), bits(kn), slots))
    np.testing.assert_array_equal(np.asarray(vo), numpy_write(bits(v), bits(vn), slots))
    # Read back, the bits are exactly the bfloat16 rounding of the rows.
    rounded = np.asarray(jnp.asarray(kn, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(to_float32(ko)), numpy_write(np.asarray(to_float32(bits(k))), rounded, slots))


def test_reference_stacked_layers_match_4d():
    k, v, kn, vn, slots = make(np.random.default_rng(1))
    k5 = jnp.stack([jnp.zeros_like(k), jnp.asarray(k), jnp.ones_like(k)])
    v5 = jnp.stack([jnp.zeros_like(v), jnp.asarray(v), jnp.ones_like(v)])
    ko, vo = write_kv_reference(*map(jnp.asarray, (k, v, kn, vn, slots)))
    k5o, v5o = write_kv_reference(k5, v5, jnp.asarray(kn), jnp.asarray(vn),
                                  jnp.asarray(slots), layer=jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(k5o[1]), np.asarray(ko))
    np.testing.assert_array_equal(np.asarray(v5o[1]), np.asarray(vo))
    np.testing.assert_array_equal(np.asarray(k5o[0]), 0)
    np.testing.assert_array_equal(np.asarray(v5o[2]), 1)


def test_reference_is_in_place_when_donated():
    k, v, kn, vn, slots = make(np.random.default_rng(2))
    step = jax.jit(lambda k, v, kn, vn, s: write_kv_reference(k, v, kn, vn, s),
                   donate_argnums=(0, 1))
    hlo = step.lower(*map(jnp.asarray, (k, v, kn, vn, slots))).compile().as_text()
    assert "copy(" not in hlo.split("ENTRY")[1]  # scatters straight into the donated buffers


def test_validation_errors():
    k, v, kn, vn, slots = map(jnp.asarray, make(np.random.default_rng(3)))
    with pytest.raises(ValueError, match="k_new must be"):
        write_kv_reference(k, v, kn[:, :1], vn[:, :1], slots)
    with pytest.raises(ValueError, match="v_new shape"):
        write_kv_reference(k, v, kn, vn[:-1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_reference(k, v, kn, vn, slots[:-1])
    with pytest.raises(ValueError, match="integer"):
        write_kv_reference(k, v, kn, vn, slots.astype(jnp.float32))
    with pytest.raises(ValueError, match="5-D"):
        write_kv_reference(k, v, kn, vn, slots, layer=0)
    with pytest.raises(ValueError, match="shapes differ"):
        write_kv_reference(k, v[:1], kn, vn, slots)


@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,dtype", [
    (8, 64, 3, np.float32), (16, 128, 2, jnp.bfloat16),
])
def test_kernel_matches_reference(block_size, head_dim, num_kv_heads, dtype):
    args = make(np.random.default_rng(5), num_kv_heads, 5, block_size, head_dim, 7, dtype)
    args = tuple(map(jnp.asarray, args))
    want = write_kv_reference(*args)
    got = write_kv(*args, interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_kernel_stacked_layers():
    k, v, kn, vn, slots = map(jnp.asarray, make(np.random.default_rng(6), num_tokens=5))
    k5, v5 = jnp.stack([k, k + 1]), jnp.stack([v, v + 1])
    got = write_kv(k5, v5, kn, vn, slots, layer=jnp.int32(1), interpret=True)
    want = write_kv_reference(k5, v5, kn, vn, slots, layer=jnp.int32(1))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("stacked", [False, True])
def test_kernel_lowers_to_triton(stacked):
    from functools import partial

    from jax import export

    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = sds(((4,) if stacked else ()) + (8, 512, 16, 128), bf16)
    fn = partial(write_kv, layer=jnp.int32(3) if stacked else None)
    exp = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(cache, cache, sds((256, 8, 128), bf16), sds((256, 8, 128), bf16), sds((256,), i32))
    assert "xla.gpu.triton" in exp.mlir_module()
