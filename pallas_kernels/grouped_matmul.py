"""Grouped matmul for Mixture-of-Experts at decode sizes: out[m] = lhs[m] @ rhs[group of m].

lhs [M, K] holds the (token, expert) rows sorted by expert: group e is the next
group_sizes[e] rows (rows past sum(group_sizes) are padding: output 0). rhs
[E, N, K] stacks the experts' weights, each [out, in] as nn.Linear stores it
(out[m] = lhs[m] @ rhs[e].T). Or rhs [L, E, N, K], every layer's stacks, and
`layer`: the kernel reads that layer's experts in place, where a slice of the
stack handed to the custom call would likely be a copy of the layer's stack
(the model's layer scan holds the stacks this way: models/expert_weights.py).

Alignment (vLLM's `moe_align_block_size`, in jnp: `align_block_size`): each
group is cut into row blocks of `block_m` rows, its last block padded, so
every row block belongs to exactly one expert:

    group_sizes  [3, 0, 17, 1]   block_m 16
    blocks       e0:[0,3) | e2:[3,19) e2:[19,20) | e3:[20,21) | dead dead ...
    block_expert [0, 2, 2, 3, ..]   block_start [0, 3, 19, 20, ..]   block_rows [3, 16, 1, 1, 0, ..]

The grid is static (Pallas Triton rejects dynamic grids): (row blocks, column
tiles) with row blocks = cdiv(M, block_m) + min(E, M), a bound on
sum(cdiv(group_sizes, block_m)); dead blocks (block_rows 0) exit at once. A
program loads its expert's [block_n, K] rows tile by tile (the expert index
read from the table, so inactive experts' weights are never read) and
contracts each [block_n, block_k] tile on K (tl.dot, tile transposed) with its
block_m rows of lhs, accumulating in float32. Rows past a group's end that its
last block reads belong to the next group (or padding) and are not stored.

Why not tokamax's `ragged_dot` (PyPI tokamax 0.0.12, which installs and runs
with jax 0.10 here): its GPU paths are a Mosaic GPU kernel for sm90/sm100 only
and a Pallas Triton kernel whose grid is (cdiv(M, block_m), column tiles, E):
one program per expert per row tile, 128x the programs of this kernel at
decode sizes with 128 experts. And its Triton implementation refuses to lower
from a host without a GPU (`NotImplementedError: Not supported on cpu`), so it
cannot be exported for cuda and checked on this CPU machine as the project's
kernels are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import triton_params

# Tuning: rows per block (tl.dot needs >= 16), output columns and K per step; untuned on a GPU.
TUNING = {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 2}


def _tile(dim: int, largest: int) -> int | None:
    """The largest power of two <= `largest` and >= 16 dividing dim, or None."""
    t = largest
    while t >= 16:
        if dim % t == 0:
            return t
        t //= 2
    return None


def supported(k: int, n: int) -> bool:
    """Shapes the kernel takes: K and N multiples of 16."""
    return _tile(k, TUNING["block_k"]) is not None and _tile(n, TUNING["block_n"]) is not None


def num_row_blocks(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static bound on sum(cdiv(group_sizes, block_m)) when sum(group_sizes) <= num_rows: every
    group adds at most one partial block, and at most num_rows groups are non-empty."""
    return -(-num_rows // block_m) + min(num_groups, num_rows)


def align_block_size(group_sizes: jax.Array, num_rows: int, block_m: int):
    """vLLM's moe_align_block_size for rows already sorted by group: group_sizes i32[E] ->
    (block_expert, block_start, block_rows), each i32[B] with B = num_row_blocks(...): the expert of
    each row block, its first row in lhs, and its real rows (0: a dead block past the last group)."""
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    num_groups = gs.shape[0]
    blocks = (gs + block_m - 1) // block_m  # [E] row blocks of each group
    cu_blocks = jnp.cumsum(blocks)
    group_start = jnp.cumsum(gs) - gs  # [E] first row of each group
    b = jnp.arange(num_row_blocks(num_rows, num_groups, block_m), dtype=jnp.int32)
    expert = jnp.clip(jnp.searchsorted(cu_blocks, b, side="right"), 0, num_groups - 1).astype(jnp.int32)
    j = b - (cu_blocks[expert] - blocks[expert])  # block index within its group
    live = b < cu_blocks[-1]
    start = jnp.where(live, group_start[expert] + j * block_m, 0)
    rows = jnp.where(live, jnp.clip(gs[expert] - j * block_m, 0, block_m), 0)
    return expert, start.astype(jnp.int32), rows.astype(jnp.int32)


def _precision(a: jax.Array):
    return lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # IEEE, not TF32, for float32


def _kernel(
    block_expert_ref,  # i32[B]: expert of row block b
    block_start_ref,  # i32[B]: first lhs row of block b
    block_rows_ref,  # i32[B]: real rows of block b (0: dead)
    layer_ref,  # i32[1]: the layer of rhs
    lhs_ref,  # [M + block_m, K]: whole (padded so every block's rows are in range)
    rhs_ref,  # [L, E, N, K]: whole
    o_ref,  # [M + block_m, N]: whole; rows stored only by their block
    *,
    block_m: int,
    block_n: int,
    block_k: int,
):
    b, j = pl.program_id(0), pl.program_id(1)
    expert, start, rows = block_expert_ref[b], block_start_ref[b], block_rows_ref[b]
    layer = layer_ref[0]
    cols = pl.ds(j * block_n, block_n)
    num_k = lhs_ref.shape[1] // block_k

    @pl.when(rows > 0)
    def _():
        def body(i, acc):  # acc f32[block_m, block_n]
            x = lhs_ref[pl.ds(start, block_m), pl.ds(i * block_k, block_k)]  # [block_m, block_k]
            w = rhs_ref[layer, expert, cols, pl.ds(i * block_k, block_k)]  # [block_n, block_k]
            return acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=_precision(x),
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, num_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        live = lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0) < rows
        pltriton.store(o_ref.at[pl.ds(start, block_m), cols], acc.astype(o_ref.dtype), mask=live)


def _grouped_pallas(lhs, rhs, group_sizes, layer, *, interpret: bool):
    m, k = lhs.shape
    n = rhs.shape[-2]
    if layer is None:
        rhs, layer = rhs[None], 0  # [1, E, N, K]: a bitcast
    block_m = max(TUNING["block_m"], 16)
    block_n, block_k = _tile(n, TUNING["block_n"]), _tile(k, TUNING["block_k"])
    table = align_block_size(group_sizes, m, block_m)
    x = jnp.pad(lhs.astype(rhs.dtype), ((0, block_m), (0, 0)))  # tl.dot: operands of one dtype
    whole = pl.BlockSpec()
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k),
        grid=(table[0].shape[0], n // block_n),
        in_specs=[whole] * 6,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((m + block_m, n), lhs.dtype),
        compiler_params=triton_params(TUNING["num_warps"], TUNING["num_stages"]),
        interpret=interpret,
        name="grouped_matmul",
    )(*table, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), x, rhs)
    # Rows no block stores (padding past sum(group_sizes)) are garbage: zeros, as ragged_dot gives.
    total = jnp.sum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
    return jnp.where((jnp.arange(m) < total)[:, None], out[:m], jnp.zeros((), lhs.dtype))


def _check(lhs, rhs, group_sizes, layer=None) -> None:
    want = 3 if layer is None else 4
    if lhs.ndim != 2 or rhs.ndim != want:
        raise ValueError(f"lhs must be [M, K] and rhs {'[E, N, K]' if layer is None else '[L, E, N, K] (with layer)'}; "
                         f"got {lhs.shape}, {rhs.shape}")
    if layer is not None and (jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
        raise ValueError(f"layer must be an integer scalar; got shape {jnp.shape(layer)}")
    if lhs.shape[1] != rhs.shape[-1]:
        raise ValueError(f"lhs K={lhs.shape[1]} != rhs K={rhs.shape[-1]} (rhs is [..., E, N, K])")
    if group_sizes.shape != (rhs.shape[-3],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be an integer array [E={rhs.shape[-3]}]; got shape "
                         f"{group_sizes.shape} dtype {group_sizes.dtype}")
    if not (jnp.issubdtype(lhs.dtype, jnp.floating) and jnp.issubdtype(rhs.dtype, jnp.floating)):
        raise ValueError(f"lhs and rhs must be floating point; got {lhs.dtype}, {rhs.dtype}")
    if lhs.shape[0] == 0:
        raise ValueError("lhs must have at least one row")


@functools.partial(jax.jit, static_argnames=("interpret",))
def grouped_matmul(
    lhs: jax.Array,  # [M, K] float, rows sorted by group
    rhs: jax.Array,  # [E, N, K] float; with layer: [L, E, N, K]
    group_sizes: jax.Array,  # i32[E], sum <= M
    layer: jax.Array | int | None = None,  # i32 scalar: rhs[layer]'s experts, read in place
    *,
    interpret: bool = False,
) -> jax.Array:  # [M, N] in lhs.dtype; rows past sum(group_sizes) are 0
    """Pallas (Triton) grouped matmul; same semantics as `grouped_matmul_reference`."""
    _check(lhs, rhs, group_sizes, layer)
    if not supported(lhs.shape[1], rhs.shape[-2]):
        raise ValueError(f"the Pallas kernel needs K and N multiples of 16; got K={lhs.shape[1]}, "
                         f"N={rhs.shape[-2]} (use grouped_matmul_reference)")
    return _grouped_pallas(lhs, rhs, group_sizes, layer, interpret=interpret)


@jax.jit
def grouped_matmul_reference(
    lhs: jax.Array,  # [M, K] float, rows sorted by group
    rhs: jax.Array,  # [E, N, K] float; with layer: [L, E, N, K]
    group_sizes: jax.Array,  # i32[E], sum <= M
    layer: jax.Array | int | None = None,
) -> jax.Array:  # [M, N] in lhs.dtype; rows past sum(group_sizes) are 0
    """Pure jnp: each row times its group's weight, in float32 (a test oracle: it gathers an
    [M, K, N] weight per row)."""
    _check(lhs, rhs, group_sizes, layer)
    rhs = rhs if layer is None else rhs[layer]
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    row = jnp.arange(lhs.shape[0], dtype=jnp.int32)
    group = jnp.clip(jnp.searchsorted(jnp.cumsum(gs), row, side="right"), 0, rhs.shape[0] - 1)
    out = jnp.einsum("mk,mnk->mn", lhs.astype(jnp.float32), rhs[group].astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    return jnp.where((row < gs.sum())[:, None], out, 0.0).astype(lhs.dtype)


__all__ = ["align_block_size", "grouped_matmul", "grouped_matmul_reference", "num_row_blocks", "supported"]
