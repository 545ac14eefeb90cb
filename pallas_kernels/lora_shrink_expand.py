"""Batched LoRA for decode sizes (Punica's BGMV; vLLM's lora_shrink then lora_expand):
y[m] = (x[m] @ A[:, slot m]) @ B[slot m, :] for every row m, 0 where slot[m] == 0.

Layout: jaxserve/lora/layers.py's stacked slots of one layer,
    a [K, S * R]   slot s (1-based) owns columns (s - 1) * R .. s * R
    b [S * R, N]   rows likewise (PEFT's scaling folded in)
and slots [M] i32 (0: the base model). Two Pallas programs, as vLLM's two kernels:

    shrink   grid (M,): row m reads its slot, and x[m] against that slot's [K, R] columns of a,
             K in BLOCK_K chunks (elementwise products summed in float32: one row is too few for
             tl.dot's 16) -> shrunk [M, R] float32
    expand   grid (M, N / BLOCK_N): shrunk[m] [R] against the slot's [R, BLOCK_N] rows of b

Only the token's slot's R columns of a and R rows of b are read (the XLA path's one-hot product
reads all S * R), which is what matters at decode sizes, where the step is bound by bytes read;
a is read once per row (the shrink is not recomputed by each output tile).

The engine's CPU path is the XLA one (layers.delta); on GPUs this kernel takes steps of at most
MAX_ROWS tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import triton_params

MAX_ROWS = 64
BLOCK_K = 64  # K chunk of the shrink
BLOCK_N = 64  # output columns per expand program
# Triton launch parameters; untuned on a GPU so far.
TUNING = {"num_warps": 4, "num_stages": 2}


def supported(k: int, n: int, rank: int) -> bool:
    """Shapes the kernel takes: K and N in whole chunks, a power-of-two rank (Triton block shapes)."""
    return k % BLOCK_K == 0 and n % BLOCK_N == 0 and rank >= 1 and rank & (rank - 1) == 0


def _slot_start(slots_ref, m, rank: int):
    slot = slots_ref[pl.ds(m, 1)][0]  # scalar i32
    return slot, jnp.maximum(slot - 1, 0) * rank


def _shrink_kernel(
    x_ref,  # [M, K] x.dtype: whole
    slots_ref,  # i32[M]: whole
    a_ref,  # [K, S * R]: whole
    o_ref,  # [1, R] f32: row m
    *,
    rank: int,
):
    m = pl.program_id(0)
    _, start = _slot_start(slots_ref, m, rank)

    def chunk(c, acc):  # acc [R] f32
        x = x_ref[m, pl.ds(c * BLOCK_K, BLOCK_K)].astype(jnp.float32)  # [BLOCK_K]
        a = a_ref[pl.ds(c * BLOCK_K, BLOCK_K), pl.ds(start, rank)].astype(jnp.float32)  # [BLOCK_K, R]
        return acc + jnp.sum(x[:, None] * a, axis=0)

    shrunk = jax.lax.fori_loop(0, x_ref.shape[1] // BLOCK_K, chunk, jnp.zeros((rank,), jnp.float32))
    o_ref[...] = shrunk[None, :]


def _expand_kernel(
    shrunk_ref,  # [1, R] f32: row m
    slots_ref,  # i32[M]: whole
    b_ref,  # [S * R, N]: whole
    o_ref,  # [1, BLOCK_N] out dtype: row m, this program's column tile
    *,
    rank: int,
):
    m, j = pl.program_id(0), pl.program_id(1)
    slot, start = _slot_start(slots_ref, m, rank)
    b = b_ref[pl.ds(start, rank), pl.ds(j * BLOCK_N, BLOCK_N)].astype(jnp.float32)  # [R, BLOCK_N]
    out = jnp.sum(shrunk_ref[0, :][:, None] * b, axis=0)  # [BLOCK_N]
    out = jnp.where(slot > 0, out, jnp.zeros_like(out))
    o_ref[...] = out[None, :].astype(o_ref.dtype)


def _pallas(x, slots, a, b, *, rank: int, interpret: bool):
    m, n = x.shape[0], b.shape[1]
    whole = pl.BlockSpec()
    shrunk = pl.pallas_call(
        functools.partial(_shrink_kernel, rank=rank),
        grid=(m,),
        in_specs=[whole, whole, whole],
        out_specs=pl.BlockSpec((1, rank), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, rank), jnp.float32),
        compiler_params=triton_params(**TUNING),
        interpret=interpret,
        name="lora_shrink",
    )(x, slots, a)
    return pl.pallas_call(
        functools.partial(_expand_kernel, rank=rank),
        grid=(m, n // BLOCK_N),
        in_specs=[pl.BlockSpec((1, rank), lambda i, j: (i, 0)), whole, whole],
        out_specs=pl.BlockSpec((1, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=triton_params(**TUNING),
        interpret=interpret,
        name="lora_expand",
    )(shrunk, slots, b)


def _check(x, slots, a, b, rank: int) -> None:
    if x.ndim != 2 or a.ndim != 2 or b.ndim != 2 or slots.ndim != 1:
        raise ValueError(f"x [M, K], slots [M], a [K, S*R], b [S*R, N] expected; got {x.shape}, {slots.shape}, "
                         f"{a.shape}, {b.shape}")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1..{MAX_ROWS} rows (decode sizes); got {m}")
    if slots.shape != (m,) or slots.dtype != jnp.int32:
        raise ValueError(f"slots must be i32[{m}]; got {slots.dtype}{list(slots.shape)}")
    if a.shape[0] != k or a.shape[1] != b.shape[0] or a.shape[1] % rank:
        raise ValueError(f"a must be [K={k}, S*R] and b [S*R, N] with S*R a multiple of rank {rank}; "
                         f"got {a.shape}, {b.shape}")
    if not supported(k, b.shape[1], rank):
        raise ValueError(f"K={k} (a multiple of {BLOCK_K}), N={b.shape[1]} (a multiple of {BLOCK_N}) and a "
                         f"power-of-two rank (got {rank}) are required")


@functools.partial(jax.jit, static_argnames=("rank", "interpret"))
def lora_shrink_expand(
    x: jax.Array,  # [M, K] float, M <= 64
    slots: jax.Array,  # i32[M], 0: no adapter
    a: jax.Array,  # [K, S * R]
    b: jax.Array,  # [S * R, N]
    *,
    rank: int,
    interpret: bool = False,
) -> jax.Array:
    """Pallas (Triton): each row's adapter delta [M, N] in x.dtype."""
    _check(x, slots, a, b, rank)
    return _pallas(x, slots, a, b, rank=rank, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("rank",))
def lora_shrink_expand_reference(
    x: jax.Array,  # [M, K] float
    slots: jax.Array,  # i32[M]
    a: jax.Array,  # [K, S * R]
    b: jax.Array,  # [S * R, N]
    *,
    rank: int,
) -> jax.Array:
    """Pure-jnp: the XLA path's one-hot form (jaxserve/lora/layers.py) in float32 -> [M, N] in x.dtype."""
    owner = jnp.arange(a.shape[1], dtype=jnp.int32) // rank + 1
    mask = (slots[:, None] == owner[None, :]).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    shrunk = jnp.dot(x.astype(jnp.float32), a.astype(jnp.float32), precision=hi) * mask
    return jnp.dot(shrunk, b.astype(jnp.float32), precision=hi).astype(x.dtype)
