"""MXFP4 experts (gpt-oss's hub format, `quant_method: mxfp4`), kept packed in device memory.

The hub stores each stacked expert projection (HF orientation [out, in] per expert) as

    *_blocks  uint8 [E, N, K / 32, 16]  two e2m1 values a byte: element 2i in the low nibble,
                                        2i + 1 in the high one, 32 elements per block
    *_scales  uint8 [E, N, K / 32]      e8m0: the block's scale is 2^(scale - 127)

and w[e, n, k] = FP4_VALUES[nibble] * 2^(scales[e, n, k // 32] - 127) (transformers'
`integrations.mxfp4.convert_moe_packed_tensors`, which returns it transposed, [E, K, N]).
`Mxfp4Weight` keeps both tensors as they are: 17 bytes per 32 weights, 0.27x bfloat16, and stands
for the output-major [E, N, K] float stack every expert form has here (models/expert_weights.py).
Nothing is dequantized at load; the expert paths dequantize only the experts a step touches,
inside the program:

    dequantize_experts(w, ids)          [len(ids), N, K] float: the experts `ids`, unpacked

Values below 2^-126 (an e8m0 scale under 2, never seen in real checkpoints) are denormal floats,
which XLA:CPU flushes to zero (and scale 0 is read as 0 everywhere); transformers keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


BLOCK = 32  # elements per e8m0 scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Mxfp4Weight:
    """Stacked expert weights [..., E, N, K] ([out, in] per expert), packed as the hub stores them."""
    blocks: jax.Array  # u8[..., E, N, K // 32, 16]: e2m1 pairs, low nibble first
    scales: jax.Array  # u8[..., E, N, K // 32]: e8m0 exponents (bias 127)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., E, N, K] shape of the float weight it stands for."""
        *lead, e, n, groups, _ = self.blocks.shape
        return (*lead, e, n, groups * BLOCK)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


def from_hub(blocks: np.ndarray, scales: np.ndarray) -> Mxfp4Weight:
    """The host weight of one `*_blocks` / `*_scales` pair as the checkpoint holds it (uint8 each;
    leading axes, e.g. a stacked layer axis, allowed). ValueError names what does not fit."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"mxfp4: *_blocks and *_scales must be uint8; got {blocks.dtype}, {scales.dtype}")
    if blocks.ndim < 4 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: *_blocks must be [E, N, K / 32, 16] and *_scales [E, N, K / 32]; got "
                         f"{blocks.shape} and {scales.shape}")
    return Mxfp4Weight(np.ascontiguousarray(blocks), np.ascontiguousarray(scales))


def _unpack(blocks: jax.Array, scales: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """u8[..., N, G, 16], u8[..., N, G] -> [..., N, K] in dtype (K = 32 G).

    e2m1 by arithmetic, not a table lookup (a gather, 6x slower on XLA:CPU): code c = s eem,
    |value| = m / 2 when ee = 0, else (1 + m / 2) 2^(ee - 1); the e8m0 scale 2^(scale - 127) is the
    float32 whose exponent bits are `scale` (scale 0, 2^-127, a denormal: 0 here)."""
    codes = jnp.stack([blocks & 15, blocks >> 4], axis=-1).astype(jnp.int32)  # [..., N, G, 16, 2]
    exp, mant = (codes & 7) >> 1, (codes & 1).astype(jnp.float32)
    mag = jnp.where(exp == 0, mant * 0.5, (1.0 + mant * 0.5) * (1 << jnp.maximum(exp - 1, 0)).astype(jnp.float32))
    vals = jnp.where(codes >= 8, -mag, mag).reshape(*blocks.shape[:-1], BLOCK)  # [..., N, G, 32]
    scale = jax.lax.bitcast_convert_type(scales.astype(jnp.int32) << 23, jnp.float32)  # [..., N, G]
    w = vals * scale[..., None]  # exact: a power-of-two scale
    return w.reshape(*w.shape[:-2], -1).astype(dtype)  # [..., N, K]


def dequantize(w: Mxfp4Weight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The whole float weight [..., E, N, K] (tests and small models; the matmuls unpack only what they use)."""
    return _unpack(w.blocks, w.scales, dtype)


def dequantize_experts(w: Mxfp4Weight, expert_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Experts `expert_ids` (i32[B], clipped into range) of one layer's [E, N, K] weight -> [B, N, K]:
    only their packed bytes are read."""
    ids = jnp.clip(expert_ids.astype(jnp.int32), 0, w.blocks.shape[0] - 1)
    return _unpack(jnp.take(w.blocks, ids, axis=0), jnp.take(w.scales, ids, axis=0), dtype)
