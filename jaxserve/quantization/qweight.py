"""The one quantized weight type every format is translated into at load.

A matmul weight [..., K, N] (K = in features, N = out features, the model's
[in, out] orientation; "..." is the stacked layer axis while the params are
whole, gone inside the layer scan) is one `QuantizedWeight`:

    scheme  values                    scales      zeros        perm     input_scale
    int8    int8 [..., K, N]          f32 [..., 1, N]   -       -        -      (W8A8, per-token int8 x)
    fp8     float8_e4m3fn [..., K, N] f32 [..., 1, N]   -       -        f32 [...] or None (static / dynamic x)
    fp8_block float8_e4m3fn [..., K, N] f32 [..., cdiv(K, group_size), cdiv(N, block_cols)]  (weight only)
    w8a16   uint8 [..., K, N]         [..., G, N]  uint8 [..., G, N]  i32 [..., K] or None
    w4a16   uint8 [..., K // 2, N]    [..., G, N]  uint8 [..., G, N]  i32 [..., K] or None

G = K // group_size groups along K.

fp8_block is the hub's block-wise FP8 (`quant_method: fp8`, `weight_block_size: [128, 128]`,
`weight_scale_inv`: Qwen3-*-FP8, DeepSeek-V3): one float32 scale per [group_size, block_cols]
block of the [K, N] weight, w[k, n] = values[k, n] * scales[k // group_size, n // block_cols].
The fp8 values stay in device memory; the matmul applies the block scales (matmul.py). Integer weights are unsigned with a zero
point (a symmetric checkpoint's signed values get zero 2^(bits-1)):
w[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n].

4-bit layout (chosen for the dequantizing kernel): within each group of
`group_size` rows, packed row r holds row r in its low nibble and row
r + group_size / 2 in its high nibble, so a kernel multiplies the two
contiguous halves of its x tile by the two nibbles, with no interleave.

Act-order (GPTQ desc_act): a checkpoint's g_idx sends row k to group g_idx[k].
At load the rows are sorted by group (`perm`) so groups are contiguous again,
and the matmul gathers x's columns with the same `perm` (as Marlin does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization import gguf_packed

SCHEMES = ("int8", "fp8", "w8a16", "w4a16", "fp8_block")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    values: jax.Array  # see the table in the module docstring
    scales: jax.Array  # [..., G, N]
    zeros: jax.Array | None = None  # uint8 [..., G, N] (wNa16 only)
    perm: jax.Array | None = None  # i32 [..., K]: act-order row order (wNa16 only)
    input_scale: jax.Array | None = None  # f32 [...]: static per-tensor activation scale (fp8 only)
    scheme: str = field(default="int8", metadata=dict(static=True))
    group_size: int = field(default=0, metadata=dict(static=True))  # rows per scale group
    # Tensor parallelism: (mesh, axis name, "column" | "row") when the values are split over the mesh
    # axis on N or on K (parallel.shard_params sets it), so a kernel runs on each device's shard.
    split: tuple | None = field(default=None, metadata=dict(static=True))
    block_cols: int = field(default=0, metadata=dict(static=True))  # fp8_block: columns per scale block

    @property
    def bits(self) -> int:
        return 4 if self.scheme == "w4a16" else 8

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., K, N] shape of the float weight it stands for."""
        *lead, k, n = self.values.shape
        return (*lead, k * (2 if self.bits == 4 else 1), n)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


def is_quantized(w: object) -> bool:
    return isinstance(w, QuantizedWeight)


def pack_int(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, g_idx: np.ndarray | None,
             bits: int, dtype: jnp.dtype) -> QuantizedWeight:
    """Host repack of one checkpoint's integer weight into the matmul's layout.

    q: [K, N] ints in [0, 2^bits); scales, zeros: [G, N]; g_idx: [K] group of each row or None.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    k, n = q.shape
    num_groups = scales.shape[0]
    if k % num_groups or zeros.shape != scales.shape or scales.shape[1] != n:
        raise ValueError(f"weight [{k}, {n}] does not fit scales {scales.shape} / zeros {zeros.shape}")
    group = k // num_groups
    perm = None
    if g_idx is not None and not np.array_equal(g_idx, np.arange(k) // group):
        perm = np.argsort(g_idx, kind="stable").astype(np.int32)
        if not np.array_equal(np.asarray(g_idx)[perm], np.arange(k) // group):
            raise ValueError("g_idx: groups of unequal sizes cannot be made contiguous")
        q = q[perm]
    q = q.astype(np.uint8)
    if bits == 4:
        if group % 2:
            raise ValueError(f"4-bit weights need an even group size, got {group}")
        g = q.reshape(num_groups, 2, group // 2, n)  # halves of each group
        q = (g[:, 0] | (g[:, 1] << 4)).reshape(k // 2, n)
    return QuantizedWeight(q, np.asarray(scales, np.dtype(dtype)), zeros.astype(np.uint8), perm, None,
                           "w4a16" if bits == 4 else "w8a16", group)


def stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Per-layer host weights -> one with a leading layer axis (identity perms fill the gaps)."""
    if isinstance(weights[0], gguf_packed.GGUFWeight):  # its own stack: a leaf's layers may differ in type
        return gguf_packed.stack(weights)
    if any(w.perm is not None for w in weights):
        k = weights[0].shape[-2]
        weights = [w if w.perm is not None else _with(w, perm=np.arange(k, dtype=np.int32)) for w in weights]
    return jax.tree.map(lambda *xs: np.stack(xs), *weights)


def _with(w: QuantizedWeight, **changes) -> QuantizedWeight:
    from dataclasses import replace

    return replace(w, **changes)


def unpack_values(w: QuantizedWeight) -> jax.Array:
    """The unsigned integer values [..., K, N] (rows in perm order) of a wNa16 weight."""
    v = w.values
    if w.bits == 8:
        return v
    *lead, k2, n = v.shape
    g = v.reshape(*lead, 2 * k2 // w.group_size, w.group_size // 2, n)
    return jnp.concatenate([g & 15, g >> 4], axis=-2).reshape(*lead, 2 * k2, n)


def dequantize(w: QuantizedWeight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The float weight [..., K, N] it stands for, rows in perm order (x is gathered with perm)."""
    if w.scheme in ("int8", "fp8"):
        return (w.values.astype(jnp.float32) * w.scales.astype(jnp.float32)).astype(dtype)
    if w.scheme == "fp8_block":
        return (w.values.astype(jnp.float32) * block_scales(w)).astype(dtype)
    q = unpack_values(w)
    *lead, k, n = q.shape
    groups = q.reshape(*lead, k // w.group_size, w.group_size, n).astype(jnp.float32)
    zeros = w.zeros.astype(jnp.float32)[..., None, :]
    out = (groups - zeros) * w.scales.astype(jnp.float32)[..., None, :]
    return out.reshape(*lead, k, n).astype(dtype)


def block_scales(w: QuantizedWeight) -> jax.Array:
    """An fp8_block weight's scales broadcast to every element: f32 [..., K, N]."""
    k, n = w.values.shape[-2:]
    s = jnp.repeat(w.scales.astype(jnp.float32), w.group_size, axis=-2)[..., :k, :]
    return jnp.repeat(s, w.block_cols, axis=-1)[..., :n]


def fp8_block(weight: np.ndarray, scale_inv: np.ndarray, block_size: tuple[int, int]) -> QuantizedWeight:
    """Host repack of one block-wise FP8 Linear as the hub stores it: weight e4m3 [N, K] (HF's
    [out, in]), weight_scale_inv f32 [cdiv(N, block_size[0]), cdiv(K, block_size[1])]."""
    n, k = weight.shape
    bn, bk = block_size
    want = (-(-n // bn), -(-k // bk))
    if scale_inv.shape != want:
        raise ValueError(f"weight_scale_inv is {scale_inv.shape}; a [{n}, {k}] weight in blocks {list(block_size)} "
                         f"needs {want}")
    values = np.ascontiguousarray(weight.T)  # [K, N]
    scales = np.ascontiguousarray(np.asarray(scale_inv, np.float32).T)  # [cdiv(K, bk), cdiv(N, bn)]
    return QuantizedWeight(values, scales, scheme="fp8_block", group_size=bk, block_cols=bn)


def transposed(w: QuantizedWeight) -> QuantizedWeight:
    """A host fp8_block weight [..., K, N] as [..., N, K] with its scale blocks swapped alike (MoE
    experts are stored output-major, models/expert_weights.py); `dequantize` reads either."""
    if w.scheme != "fp8_block":
        raise ValueError(f"transposed: only fp8_block weights, got {w.scheme!r}")
    swap = lambda a: np.ascontiguousarray(np.swapaxes(np.asarray(a), -1, -2))  # noqa: E731
    return QuantizedWeight(swap(w.values), swap(w.scales), scheme="fp8_block", group_size=w.block_cols,
                           block_cols=w.group_size)


def dense_weight(w: QuantizedWeight) -> np.ndarray:
    """Host float32 [..., K, N] in the original row order (tests compare it with a checkpoint's)."""
    d = np.asarray(dequantize(w))
    if w.perm is None:
        return d
    out = np.empty_like(d)
    np.put_along_axis(out, np.asarray(w.perm)[..., :, None], d, axis=-2)
    return out
