"""MXFP4 experts (gpt-oss's hub layout): the packed Mxfp4Weight against transformers' own
dequantization (integrations.mxfp4.convert_moe_packed_tensors), the grouped matmul (models/expert_weights.py)
that unpacks only the touched experts, the device bytes (<= 0.3x bfloat16) and the hub tensors' checks."""

from __future__ import annotations

import numpy as np
import pytest

import torch
from transformers.integrations import mxfp4 as mxfp4_hf

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.models.expert_weights import grouped_matmul  # noqa: E402
from jaxserve.quantization import mxfp4  # noqa: E402


def hub_tensors(rng, experts: int, n: int, k: int):
    """Random *_blocks / *_scales as gpt-oss stores them (scales around 2^0, some tiny and large)."""
    blocks = rng.integers(0, 256, (experts, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 132, (experts, n, k // 32), dtype=np.uint8)
    # 2^-125, the smallest scale whose products stay normal floats (XLA:CPU flushes denormals to
    # zero; a real checkpoint has no weights near 1e-38), and 2^73.
    scales[0, 0, 0], scales[-1, -1, -1] = 2, 200
    return blocks, scales


def reference(blocks, scales) -> np.ndarray:
    """transformers' dequantized float32 weight, transposed to our output-major [E, N, K]."""
    return np.swapaxes(mxfp4_hf.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                           dtype=torch.float32).numpy(), 1, 2)


def test_dequantize_equals_transformers():
    blocks, scales = hub_tensors(np.random.default_rng(0), 4, 48, 128)
    w = jax.tree.map(jnp.asarray, mxfp4.from_hub(blocks, scales))
    want = reference(blocks, scales)
    assert w.shape == want.shape == (4, 48, 128)
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(w)), want)
    ids = jnp.asarray([3, 0, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize_experts(w, ids, jnp.float32)), want[[3, 0, 3]])


@pytest.mark.parametrize("sizes,m", [([1, 0, 2, 0, 0, 1, 0, 4], 8), ([0, 19, 0, 0, 0, 0, 0, 0], 24),
                                     ([3, 5, 9, 1, 0, 2, 7, 4], 31)])
def test_grouped_matmul_matches_the_dequantized_experts(sizes, m):
    rng = np.random.default_rng(m)
    blocks, scales = hub_tensors(rng, len(sizes), 64, 96)
    blocks[..., 0, 0] = 0  # keep the 2^73 block out of the products
    scales = np.minimum(scales, 131).astype(np.uint8)
    w = jax.tree.map(jnp.asarray, mxfp4.from_hub(blocks, scales))
    x = rng.standard_normal((m, 96)).astype(np.float32)
    got = np.asarray(grouped_matmul(jnp.asarray(x), w, jnp.asarray(sizes, jnp.int32)))
    dense = reference(blocks, scales).astype(np.float64)
    group = np.repeat(np.arange(len(sizes)), sizes)
    want = np.zeros((m, 64))
    want[:len(group)] = np.einsum("mk,mnk->mn", x[:len(group)].astype(np.float64), dense[group])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.all(got[len(group):] == 0)


def test_device_bytes_under_0_3x_bfloat16():
    # gpt-oss-20b's expert widths, few experts: [E, 2 * 2880, 2880] gate_up and [E, 2880, 2880] down.
    rng = np.random.default_rng(1)
    for n, k in ((5760, 2880), (2880, 2880)):
        w = mxfp4.from_hub(*hub_tensors(rng, 2, n, k))
        assert w.nbytes <= 0.3 * 2 * np.prod(w.shape), w.nbytes / (2 * np.prod(w.shape))


def test_hub_tensor_checks():
    blocks, scales = hub_tensors(np.random.default_rng(2), 2, 32, 64)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.from_hub(blocks.astype(np.int32), scales)
    with pytest.raises(ValueError, match=r"\[E, N, K / 32, 16\]"):
        mxfp4.from_hub(blocks[..., :8], scales)


def test_the_hub_config_is_detected():
    from jaxserve.quantization.formats import detect

    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens",
                                                              "lm_head", "model.layers.*.mlp.router"]}
    spec = detect({"quantization_config": qc}, "mxfp4")
    assert spec.method == "mxfp4" and spec.scheme == "mxfp4" and spec.group_size == 32
