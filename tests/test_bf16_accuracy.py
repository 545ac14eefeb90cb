"""The CPU default's bfloat16 dots (`--dtype auto` where the CPU has bfloat16 dot instructions:
engine/config.py's bf16_dots_from) against float64 numpy of the float32 values, each with its bound.

bfloat16 keeps 8 significant bits: rounding an operand to it (round to nearest) changes it by at
most u = 2^-8 of itself, so a product of two rounded operands is within 2u + u^2 of the exact
product, and float32 sums of K such products (what preferred_element_type=float32 asks) add at
most K * 2^-24 of the sum of their magnitudes. So for y = x @ w, elementwise,

    |y_bf16 - y| <= (2u + u^2 + K * 2^-24) * (|x| @ |w|)                  (the worst case: every
                                                                             rounding one way)
and, the roundings being independent and of either sign, the error of a whole output is about
u / sqrt(3) * sqrt(2) of its typical size (each rounding's relative error spread within +-u:
at most u / sqrt(3) rms; two per product): rms(error) / rms(y) <= 2^-7 holds with a margin of about 2.5x (measured 0.59u).

MoE experts: tests/test_moe.py (test_bfloat16_bits_read_as_their_float32_values) states its bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

U = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits


def worst_case(k: int) -> float:
    """The elementwise factor on |x| @ |w| of a K-term dot of two bfloat16-rounded operands (module docstring)."""
    return 2 * U + U * U + k * 2.0**-24


def rms_ratio(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def test_dense_bf16_dots_within_the_bound():
    """quantization.matmul's float path with dots=bfloat16 (every projection of a step of at least
    bf16_dots_from tokens on the CPU default) against numpy float64 of the float32 operands."""
    from jaxserve.quantization.matmul import matmul

    rng = np.random.default_rng(0)
    k = 576  # the default model's hidden size
    x = rng.standard_normal((64, k)).astype(np.float32)
    w = (rng.standard_normal((k, 192)) / np.sqrt(k)).astype(np.float32)
    got = np.asarray(jax.jit(matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(w), jnp.bfloat16), np.float64)
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert not np.array_equal(got, np.asarray(matmul(jnp.asarray(x), jnp.asarray(w)), np.float64))  # bfloat16 ran
    bound = worst_case(k) * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    assert rms_ratio(got, want) <= 2 * U  # independent roundings (module docstring)


def test_lora_delta_bf16_dots_within_the_bound():
    """lora.layers.delta with dots=bfloat16, as a step of bfloat16 dots takes the adapters' deltas
    (the XLA one-hot path: shrink x @ a, mask to each token's slot, expand @ b), against numpy
    float64. Two dots in series: the shrink's result s is within g1 * (|x| @ |a|) (g1 = worst_case(in)),
    then rounded to bfloat16 for the expand, whose products are within g2 = worst_case(S*R) of
    exact, so |delta_bf16 - delta| <= ((g1 + g2 * (1 + g1)) * mask * (|x| @ |a|)) @ |b|; rms: four
    independent roundings on the way (x, a, s, b), each at most u / sqrt(3) rms: about 2u / sqrt(3)
    of the delta's size, so rms(error) / rms(delta) <= 2^-7 (measured 0.87u)."""
    from jaxserve.lora.layers import delta, slot_mask

    rng = np.random.default_rng(1)
    t, k, n, slots, rank = 48, 576, 192, 3, 16
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = (rng.standard_normal((k, slots * rank)) / np.sqrt(k)).astype(np.float32)
    b = (rng.standard_normal((slots * rank, n)) * 0.1).astype(np.float32)  # PEFT's scaling folded in
    tok_slots = rng.integers(0, slots + 1, t).astype(np.int32)  # 0: the base model, no delta
    owner = np.repeat(np.arange(1, slots + 1, dtype=np.int32), rank).reshape(slots, rank)
    mask = slot_mask(jnp.asarray(tok_slots), jnp.asarray(owner))
    run = jax.jit(lambda x, a, b, m: delta(x, {"a": a, "b": b}, m, "wq", jnp.bfloat16))
    got = np.asarray(run(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), mask), np.float64)
    m = np.asarray(mask, np.float64)
    x64, a64, b64 = (v.astype(np.float64) for v in (x, a, b))
    want = ((x64 @ a64) * m) @ b64
    assert np.all(got[tok_slots == 0] == 0) and np.abs(want[tok_slots > 0]).min() > 0
    g1, g2 = worst_case(k), worst_case(slots * rank)
    bound = ((g1 + g2 * (1 + g1)) * m * (np.abs(x64) @ np.abs(a64))) @ np.abs(b64)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / np.maximum(bound, 1e-30))
    f32 = np.asarray(jax.jit(lambda x, a, b, m: delta(x, {"a": a, "b": b}, m, "wq"))(
        jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), mask), np.float64)
    assert not np.array_equal(got, f32)  # the bfloat16 dots ran
    assert rms_ratio(got, want) <= 2 * U
