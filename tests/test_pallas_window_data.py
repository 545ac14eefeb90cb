"""A sliding window given as data (`window=`, an i32 scalar; gpt-oss's per-layer windows inside one
scanned layer body): the XLA references and both Pallas kernels (interpret mode) equal the static
`sliding_window` they replace, FULL_WINDOW equals no window, one program serves every window, and
the kernels lower for cuda with it."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.models.attention import FULL_WINDOW
from pallas_kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.testing import make_batch, numpy_attention
from tests.test_pallas_attention_sinks import MIXED, decode, decode_batch, ragged, rel_err, sinks_for



@pytest.mark.parametrize("fn", [ragged_paged_attention_reference,
                                partial(ragged_paged_attention, interpret=True)], ids=["reference", "kernel"])
def test_ragged_window_as_data_equals_static(fn):
    b = make_batch(np.random.default_rng(1), MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=8,
                   max_num_seqs=len(MIXED) + 1, pad_tokens=3)
    sinks = jnp.asarray(sinks_for(4))
    for window, static in ((5, 5), (FULL_WINDOW, None)):
        want = numpy_attention(b, sm_scale=0.125, sliding_window=static, sinks=np.asarray(sinks))
        out = ragged(b, fn, sm_scale=0.125, sinks=sinks, window=jnp.int32(window))
        assert rel_err(out, want) < 1e-5, window
    assert rel_err(numpy_attention(b, sm_scale=0.125, sliding_window=5),
                   numpy_attention(b, sm_scale=0.125)) > 1e-2  # the window changes the answer


@pytest.mark.parametrize("fn", [paged_attention_decode_reference,
                                partial(paged_attention_decode, interpret=True)], ids=["reference", "kernel"])
def test_decode_window_as_data_equals_static(fn):
    b = decode_batch(8, 64, 3, 2)
    for window, static in ((6, 6), (FULL_WINDOW, None)):
        want = numpy_attention(b, sm_scale=0.125, sliding_window=static)
        out = decode(b, fn, sm_scale=0.125, window=jnp.int32(window))
        assert rel_err(out, want) < 1e-5, window


def test_one_program_for_every_window_and_validation():
    b = decode_batch(8, 64, 3, 2)
    traced = jax.jit(lambda w: decode(b, paged_attention_decode_reference, sm_scale=0.125, window=w))
    a, c = traced(jnp.int32(6)), traced(jnp.int32(FULL_WINDOW))
    assert traced._cache_size() == 1 and rel_err(a, np.asarray(c, np.float64)) > 1e-3
    with pytest.raises(ValueError, match="window"):
        decode(b, paged_attention_decode_reference, sm_scale=0.125, window=jnp.float32(6))


@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_kernels_with_window_data_lower_for_cuda(kernel):
    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = sds((4, 8, 512, 16, 64), bf16)  # gpt-oss-20b's attention: 64 q heads, 8 kv heads
    if kernel == "ragged":
        fn = partial(ragged_paged_attention, sm_scale=0.125, layer=jnp.int32(1))
        args = (sds((256, 64, 64), bf16), cache, cache, sds((32,), i32), sds((32, 64), i32), sds((33,), i32),
                sds((), i32))
    else:
        fn = partial(paged_attention_decode, sm_scale=0.125, layer=jnp.int32(1))
        args = (sds((32, 64, 64), bf16), cache, cache, sds((32,), i32), sds((32, 64), i32))
    exp = export.export(jax.jit(lambda *a: fn(*a[:-2], sinks=a[-2], window=a[-1])), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
                        )(*args, sds((64,), jnp.float32), sds((), i32))
    assert "xla.gpu.triton" in exp.mlir_module()
