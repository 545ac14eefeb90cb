"""W4A16 group-wise dequantizing matmul for decode batches: y = x @ dequant(w).

x [M, K] (float, M <= 64: decode) times a 4-bit weight [K, N] stored as
uint8 [K // 2, N] (jaxserve.quantization.qweight's layout: in each group of
`group_size` rows, packed row r holds row r in its low nibble and row
r + group_size / 2 in its high one), with per-group scales [K // group_size, N]
and uint8 zero points: w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n].

One program per (row tile, column tile of block_n outputs) walks K one group
at a time: it loads the group's two x half-tiles and its [group_size / 2,
block_n] packed bytes, unpacks the nibbles in registers, scales them and
accumulates two tl.dots in float32. The weight is read from HBM once, at half a
byte a value: at decode sizes the matmul is bound by those bytes, which is
where a 4-bit kernel beats a 16-bit dot (Marlin's anchor: 3.9x at M <= 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import next_power_of_2, triton_params

MAX_ROWS = 64
BLOCK_N = 64  # output columns per program: K / group_size * 2 dots of [16..64, gs/2] x [gs/2, 64]
# Triton launch parameters; untuned on a GPU so far (scripts/gpu_quant.py measures them).
TUNING = {"num_warps": 4, "num_stages": 2}


def supported(k: int, n: int, group_size: int) -> bool:
    """Shapes the kernel takes: whole groups of a power-of-two size >= 32, N in whole column tiles."""
    return (group_size >= 32 and group_size & (group_size - 1) == 0 and k % group_size == 0
            and n % BLOCK_N == 0)


def _precision(x: jax.Array):
    return lax.Precision.HIGHEST if x.dtype == jnp.float32 else None  # IEEE, not TF32, for float32


def _kernel(
    x_ref,  # [M_pad, K] x.dtype: whole
    w_ref,  # u8[K // 2, N]: whole
    s_ref,  # [K // group_size, N]: whole
    z_ref,  # u8[K // group_size, N]: whole
    o_ref,  # [block_m, BLOCK_N]: this program's output tile
    *,
    group_size: int,
    block_m: int,
):
    i, j = pl.program_id(0), pl.program_id(1)
    half = group_size // 2
    rows, cols = pl.ds(i * block_m, block_m), pl.ds(j * BLOCK_N, BLOCK_N)
    dtype = x_ref.dtype

    def body(g, acc):  # acc [block_m, BLOCK_N] f32
        x_lo = x_ref[rows, pl.ds(g * group_size, half)]  # [block_m, half]
        x_hi = x_ref[rows, pl.ds(g * group_size + half, half)]  # [block_m, half]
        packed = w_ref[pl.ds(g * half, half), cols]  # u8[half, BLOCK_N]
        scale = s_ref[pl.ds(g, 1), cols].astype(jnp.float32)  # [1, BLOCK_N]
        zero = z_ref[pl.ds(g, 1), cols].astype(jnp.float32)  # [1, BLOCK_N]
        lo = (((packed & 15).astype(jnp.float32) - zero) * scale).astype(dtype)  # [half, BLOCK_N]
        hi = (((packed >> 4).astype(jnp.float32) - zero) * scale).astype(dtype)  # [half, BLOCK_N]
        dims = (((1,), (0,)), ((), ()))
        acc += lax.dot_general(x_lo, lo, dims, precision=_precision(x_lo), preferred_element_type=jnp.float32)
        return acc + lax.dot_general(x_hi, hi, dims, precision=_precision(x_hi),
                                     preferred_element_type=jnp.float32)

    num_groups = w_ref.shape[0] * 2 // group_size
    acc = lax.fori_loop(0, num_groups, body, jnp.zeros((block_m, BLOCK_N), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _w4a16_pallas(x, packed, scales, zeros, *, group_size: int, interpret: bool):
    m, k = x.shape
    n = packed.shape[1]
    block_m = max(16, next_power_of_2(m))  # tl.dot needs >= 16 rows
    x_pad = jnp.pad(x, ((0, block_m - m), (0, 0)))
    whole = pl.BlockSpec()
    out = pl.pallas_call(
        functools.partial(_kernel, group_size=group_size, block_m=block_m),
        grid=(1, n // BLOCK_N),
        in_specs=[whole, whole, whole, whole],
        out_specs=pl.BlockSpec((block_m, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((block_m, n), x.dtype),
        compiler_params=triton_params(**TUNING),
        interpret=interpret,
        name="w4a16_matmul",
    )(x_pad, packed, scales, zeros)
    return out[:m]


def _check(x, packed, scales, zeros, group_size: int) -> None:
    if x.ndim != 2 or packed.ndim != 2:
        raise ValueError(f"x must be [M, K] and packed [K // 2, N]; got {x.shape}, {packed.shape}")
    m, k = x.shape
    n = packed.shape[1]
    if packed.shape[0] * 2 != k:
        raise ValueError(f"packed must be [K // 2, N] = [{k // 2}, N]; got {packed.shape}")
    if packed.dtype != jnp.uint8 or zeros.dtype != jnp.uint8:
        raise ValueError(f"packed and zeros must be uint8; got {packed.dtype}, {zeros.dtype}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1..{MAX_ROWS} rows (decode sizes); got {m}")
    if not supported(k, n, group_size):
        raise ValueError(f"group_size {group_size} (a power of two >= 32 dividing K={k}) and N={n} "
                         f"(a multiple of {BLOCK_N}) are required")
    if scales.shape != (k // group_size, n) or zeros.shape != scales.shape:
        raise ValueError(f"scales and zeros must be [{k // group_size}, {n}]; got {scales.shape}, {zeros.shape}")


@functools.partial(jax.jit, static_argnames=("group_size", "interpret"))
def w4a16_matmul(
    x: jax.Array,  # [M, K] float, M <= 64
    packed: jax.Array,  # u8[K // 2, N]
    scales: jax.Array,  # [K // group_size, N]
    zeros: jax.Array,  # u8[K // group_size, N]
    *,
    group_size: int,
    interpret: bool = False,
) -> jax.Array:
    """Pallas (Triton) x @ dequant(w) -> [M, N] in x.dtype."""
    _check(x, packed, scales, zeros, group_size)
    return _w4a16_pallas(x, packed, scales, zeros, group_size=group_size, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("group_size",))
def w4a16_matmul_reference(
    x: jax.Array,  # [M, K] float
    packed: jax.Array,  # u8[K // 2, N]
    scales: jax.Array,  # [K // group_size, N]
    zeros: jax.Array,  # u8[K // group_size, N]
    *,
    group_size: int,
) -> jax.Array:
    """Pure-jnp: unpack, dequantize in float32, one dot -> [M, N] in x.dtype."""
    k2, n = packed.shape
    g = packed.reshape(2 * k2 // group_size, group_size // 2, n)
    q = jnp.concatenate([g & 15, g >> 4], axis=1).astype(jnp.float32)  # [G, group_size, N]
    w = ((q - zeros.astype(jnp.float32)[:, None]) * scales.astype(jnp.float32)[:, None]).reshape(2 * k2, n)
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST).astype(x.dtype)
