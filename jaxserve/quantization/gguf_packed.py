"""A GGUF's quantized tensors kept quantized on the device (`--quantization gguf`).

Every GGUF block type dequantizes (gguf.quants.dequantize) as `a * q + c` over runs of `sub`
values: q a small integer, a and c one float32 each per run (c = 0 for the symmetric types).
`GGUFWeight` keeps exactly those numbers, output-major as the file stores a Linear [N, K]:

    type   sub  q (int8, one byte a value)   a [N, K // sub]          c [N, K // sub]
    Q8_0   32   qs                           d (f16)                  -
    Q4_0   32   nibble - 8                   d (f16)                  -
    Q4_1   32   nibble                       d (f16)                  m (f16)
    Q5_0   32   5-bit value - 16             d (f16)                  -
    Q4_K   32   nibble                       d * sc (f32)             -(dmin * mn) (f32)
    Q5_K   32   5-bit value                  d * sc (f32)             -(dmin * mn) (f32)
    Q6_K   16   6-bit value - 32             d * sc (f32)             -

a and c are computed at load with gguf's own float32 operations, so `dequantize` (a * q + c in
float32, widened from f16 where the file holds f16) gives gguf's values bit for bit
(tests/test_gguf_packed.py). One byte a value, not the file's 4-6 bits: XLA:CPU fuses `x @ w.T`
with the widening of a byte-per-value weight into one pass of a vectorised matrix-vector product,
while unpacking nibbles in that loop ran 2-3x slower than float32 (docs/benchmarks/log.md). So a
weight takes 1.06-1.25 bytes a value on the device, a quarter to a third of float32's.

A layer stack whose layers differ in type (Q4_K_M files: ffn_down Q4_K or Q6_K by layer) is
stored in the finest `sub` of its layers, with a c where any layer has one: still exact.
llama's q/k row permutation is a permutation of rows N, undone on q, a and c alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

# type name -> (values per block, bytes per block in the file)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
PACKED_TYPES = tuple(BLOCKS)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GGUFWeight:
    """One weight [..., N, K] (or a layer stack of them): see the module table."""
    q: jax.Array  # int8 [..., C, N, K // C]: K in C chunks (`chunks`), each row's values in order
    a: jax.Array  # f16 or f32 [..., C, N, K // C // sub]
    c: jax.Array | None = None  # like a, or None (symmetric types)
    sub: int = field(default=32, metadata=dict(static=True))  # values per (a, c) pair
    qtypes: tuple[str, ...] = field(default=(), metadata=dict(static=True))  # the file's types, for reports

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., K, N] shape (the model's [in, out] orientation) of the float weight."""
        *lead, c, n, k = self.q.shape
        return (*lead, c * k, n)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


def is_gguf(w: object) -> bool:
    return isinstance(w, GGUFWeight)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """u8 [..., bytes] -> [..., 2 * bytes]: in each run of `group` bytes the low nibbles are the
    run's first `group` values, the high nibbles the next (gguf's reshape (-1, 1, group) >> [0, 4])."""
    g = qs.reshape(*qs.shape[:-1], -1, 1, group) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (g & 15).reshape(*qs.shape[:-1], -1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each of the last axis' bytes, i < count: [..., bytes] -> [..., count, bytes]."""
    return (qh[..., None, :] >> np.arange(count, dtype=np.uint8)[:, None]) & 1


def pack(data: np.ndarray, qtype: str, n: int, k: int) -> GGUFWeight:
    """Host: one tensor's GGUF blocks (uint8, as gguf's reader gives them) -> a GGUFWeight [N, K]."""
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF type {qtype} is not kept packed; packed types: {', '.join(PACKED_TYPES)}")
    block, size = BLOCKS[qtype]
    if k % block:
        raise ValueError(f"a {qtype} tensor's rows hold {k} values, not a whole number of {block}-value blocks")
    b = np.asarray(data, np.uint8).reshape(n, k // block, size)
    f32, c = np.float32, None
    if qtype == "Q8_0":
        q, a = np.ascontiguousarray(b[..., 2:]).view(np.int8), _f16(b[..., :2])
    elif qtype == "Q4_0":
        q, a = _nibbles(b[..., 2:], 16).astype(np.int8) - np.int8(8), _f16(b[..., :2])
    elif qtype == "Q4_1":
        q, a, c = _nibbles(b[..., 4:], 16).astype(np.int8), _f16(b[..., :2]), _f16(b[..., 2:4])
    elif qtype == "Q5_0":
        hbit = (b[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        q, a = (_nibbles(b[..., 6:], 16) | (hbit.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16), _f16(b[..., :2])
    elif qtype in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min(b[..., 4:16])
        a = _f16(b[..., :2]).astype(f32)[..., None] * sc.astype(f32)  # gguf: d * sc, dmin * m in float32
        c = -(_f16(b[..., 2:4]).astype(f32)[..., None] * mn.astype(f32))  # x - y is x + (-y) exactly
        if qtype == "Q5_K":  # bit s of qh[j]: the 5th bit of value j of sub-block s
            q = _nibbles(b[..., 48:], 32).reshape(n, -1, 8, 32) | (_bits(b[..., 16:48], 8) << 4)
        else:
            q = _nibbles(b[..., 16:], 32)
        q = q.astype(np.int8)
    else:  # Q6_K: ql [128], qh [64], scales i8 [16], d f16
        ql = _nibbles(b[..., :128], 64)
        qh = (b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        q = (ql | (qh.reshape(n, -1, 256) << 4)).astype(np.int8) - np.int8(32)
        scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(f32)
        a = _f16(b[..., 208:210]).astype(f32)[..., None] * scales
    sub = 16 if qtype == "Q6_K" else 32
    parts = chunks(k, sub)
    def split(v: np.ndarray, width: int) -> np.ndarray:  # [N, width] -> [C, N, width // C]
        return np.ascontiguousarray(np.asarray(v).reshape(n, parts, width // parts).swapaxes(0, 1))

    return GGUFWeight(split(q, k), split(a, k // sub), None if c is None else split(c, k // sub), sub, (qtype,))


MAX_CHUNK = 2048  # XLA:CPU fuses a one-row product's widening up to K = 2432 and copies from 4096 on


def chunks(k: int, sub: int) -> int:
    """How many chunks a row of k values is stored in: the fewest of whole runs of `sub` (and of 32,
    so a mixed stack's types split alike) with at most MAX_CHUNK values each."""
    runs = k // 32 if k % 32 == 0 else k // sub
    for c in range(-(-k // MAX_CHUNK), runs + 1):
        if runs % c == 0:
            return c
    return 1


def _scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K-quants' 8 six-bit scales and mins from their 12 bytes (gguf's Q4_K.get_scale_min)."""
    d, m, m_d = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def take_rows(w: GGUFWeight, rows: np.ndarray) -> GGUFWeight:
    """Host: the weight with its output rows (axis N) reordered; exact, the runs lie along K."""
    take = lambda x: None if x is None else np.take(x, rows, axis=-2)  # noqa: E731
    return GGUFWeight(take(w.q), take(w.a), take(w.c), w.sub, w.qtypes)


def _refine(w: GGUFWeight, sub: int, offset: bool, dtype: np.dtype) -> GGUFWeight:
    """Host: the same values with (a, c) per `sub` values (a divisor of w.sub), a c, and a in `dtype`
    (f16 -> f32 is exact; a repeated scale is the same scale; the added c is -0.0, as x + -0.0 is x
    for every x, -0.0 included)."""
    rep = lambda x: np.repeat(np.asarray(x).astype(dtype), w.sub // sub, axis=-1)  # noqa: E731
    c = rep(w.c) if w.c is not None else (np.full_like(rep(w.a), -0.0) if offset else None)
    return GGUFWeight(w.q, rep(w.a), c, sub, w.qtypes)


def stack(weights: list[GGUFWeight]) -> GGUFWeight:
    """Host: per-layer weights -> one with a leading layer axis, in the common form of their types."""
    sub = min(w.sub for w in weights)
    offset = any(w.c is not None for w in weights)
    dtype = np.result_type(*[np.asarray(w.a).dtype for w in weights] + ([w.c.dtype for w in weights
                                                                         if w.c is not None]))
    if any(w.sub != sub or (w.c is None) == offset or np.asarray(w.a).dtype != dtype for w in weights):
        weights = [_refine(w, sub, offset, dtype) for w in weights]
    qtypes = tuple(dict.fromkeys(t for w in weights for t in w.qtypes))
    return GGUFWeight(np.stack([w.q for w in weights]), np.stack([w.a for w in weights]),
                      None if not offset else np.stack([w.c for w in weights]), sub, qtypes)


def dequantize(w: GGUFWeight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The float weight [..., N, K] (output-major, as the file stores it): gguf's float32 values
    bit for bit, then cast to `dtype`."""
    *lead, parts, n, kc = w.q.shape
    q = w.q.reshape(*lead, parts, n, kc // w.sub, w.sub).astype(jnp.float32)
    out = w.a.astype(jnp.float32)[..., None] * q
    if w.c is not None:
        out = out + w.c.astype(jnp.float32)[..., None]
    out = jnp.moveaxis(out.reshape(*lead, parts, n, kc), -3, -2)
    return out.reshape(*lead, n, parts * kc).astype(dtype)


TILE_ROWS = 64  # output rows widened at a time where XLA:CPU would widen the whole weight first


def matmul(x: jax.Array, w: GGUFWeight) -> jax.Array:
    """x [..., K] @ the weight -> [..., N]: the products of x with dequantize(w)'s values.

    XLA:CPU emits a one-row `x @ dequantize(w).T` (written with the transpose: a dot_general
    contracting the weight's last axis is not fused) as one vectorised loop over the int8 values
    when K is at most about 2400; so one row takes the weight's K chunks (MAX_CHUNK) one after the
    other (`lax.map`) and adds their products. At more rows XLA:CPU would widen the whole weight to
    float32 in memory before its library dot: the rows are taken TILE_ROWS at a time instead, each
    tile widened into the cache and multiplied there. (Summed by chunk, the products' order differs
    from one float dot's: ~1e-7 of their scale.)"""
    *lead, k = x.shape
    parts, n, kc = w.q.shape[-3:]
    rows = int(np.prod(lead)) if lead else 1
    if w.q.ndim != 3:
        return x @ dequantize(w, x.dtype).T
    x2 = x.reshape(rows, k)
    if rows == 1:
        if parts == 1:
            return (x2 @ dequantize(w, x.dtype).T).reshape(*lead, n)
        xs = x2.reshape(parts, 1, kc)  # [C, 1, Kc]: chunk c of the row
        one = lambda t: t[0] @ dequantize(GGUFWeight(*t[1:], w.sub), x.dtype).T  # noqa: E731
        ys = jax.lax.map(one, (xs, *[None if v is None else v[:, None] for v in (w.q, w.a, w.c)]))
        return ys.sum(0).reshape(*lead, n)
    if n < 2 * TILE_ROWS:
        return x @ dequantize(w, x.dtype).T
    full = n - n % TILE_ROWS

    def tile(start: jax.Array | int, size: int = TILE_ROWS) -> jax.Array:
        take = lambda v: None if v is None else jax.lax.dynamic_slice_in_dim(v, start, size, axis=1)  # noqa: E731
        return x2 @ dequantize(GGUFWeight(take(w.q), take(w.a), take(w.c), w.sub), x.dtype).T

    out = jax.lax.map(tile, jnp.arange(0, full, TILE_ROWS))  # [tiles, rows, TILE_ROWS]
    out = jnp.moveaxis(out, 0, 1).reshape(rows, full)
    if full < n:
        out = jnp.concatenate([out, tile(full, n - full)], axis=-1)
    return out.reshape(*lead, n)


def rows(w: GGUFWeight, ids: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Rows `ids` of the float weight [N, K] (an embedding lookup): gathered, then widened."""
    take = lambda x: None if x is None else jnp.take(x, ids, axis=-2)  # noqa: E731
    return dequantize(GGUFWeight(take(w.q), take(w.a), take(w.c), w.sub, w.qtypes), dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedEmbedding:
    """A GGUF's token embedding [vocab, hidden] kept as its blocks: `embed[ids]` gathers the rows'
    blocks and widens them to `dtype` (the model's), so the model's lookup reads it as an array.
    A tied LM head is the same `w` (no second copy): params["lm_head"] = embed.w."""
    w: GGUFWeight
    dtype: jnp.dtype = field(default=jnp.float32, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        parts, n, kc = self.w.q.shape
        return (n, parts * kc)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __getitem__(self, ids: jax.Array) -> jax.Array:
        return rows(self.w, ids, self.dtype)


def holds_gguf(tree: object) -> bool:
    """Whether a params tree holds any weight kept as a GGUF's blocks."""
    return any(is_gguf(x) for x in jax.tree.leaves(tree, is_leaf=is_gguf))


def unique_nbytes(tree: object) -> int:
    """Bytes of a params tree's arrays, each buffer once: a tied head is the embedding's own
    GGUFWeight (PackedEmbedding), the same arrays under two keys."""
    seen: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        seen.setdefault(id(x), x.nbytes)
    return sum(seen.values())
