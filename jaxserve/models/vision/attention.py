"""The vision tower's attention with memory linear in the program's patches, exact (the same key set per
query as transformers' per-window / per-image attention, softmax in float32).

The rows are in window order (patch_layout: each Qwen2.5-VL window's patches contiguous, images one after
another, padding last), as transformers reorders them, so:

    window blocks   a window holds at most max_window_patches(vc) patches; the rows are cut in chunks of
                    C >= that (a power of two) and each chunk's queries attend to the keys of its previous,
                    own and next chunk (a window spans at most two chunks) under the window-id mask:
                    scores [P / C, heads, C, 3C], O(P x 3C)
    full blocks     (fullatt_block_indexes, every Qwen2-VL block) a scan over key chunks of KEY_CHUNK rows
                    with an online softmax (running max, sum and output per query, flash-attention's
                    recurrence), the image-id mask deciding which keys a query sees: scores
                    [heads, P, KEY_CHUNK] per step, O(P x KEY_CHUNK)

Both are static-shaped per patch bucket: any mix of images is the same program. A row of segment -1
(padding) sees the other padding rows, itself always, so no row divides by zero. A program of at most
KEY_CHUNK patches attends densely under the mask instead (`dense_attention`): its [heads, P, P] scores
are within the same bound, and one masked softmax compiles faster than the scan and the window bands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models.vision.config import VisionConfig

KEY_CHUNK = 512  # full attention's keys per scan step: the [heads, P, KEY_CHUNK] scores bound its memory


def window_blocks(vc: VisionConfig) -> int:
    """Qwen2.5-VL's window side in merged 2x2 blocks (transformers' vit_merger_window_size); 0: none."""
    return max(1, vc.window_size // vc.spatial_merge_size // vc.patch_size) if vc.window_size else 0


def max_window_patches(vc: VisionConfig) -> int:
    """The most patches one window holds (a full window: its blocks x the patches a block merges)."""
    return window_blocks(vc) ** 2 * vc.merge_unit


def window_chunk(vc: VisionConfig, patches: int) -> int:
    """The window blocks' query chunk at a `patches`-row program: the first power of two >= a window,
    at most the program (a power of two, so the chunks tile it)."""
    chunk = 1
    while chunk < max_window_patches(vc):
        chunk *= 2
    return min(chunk, patches)


def key_chunk(patches: int) -> int:
    return min(KEY_CHUNK, patches)


def window_attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, chunk: int) -> jax.Array:
    """q, k, v [P, heads, hd], seg [P] (the window of each row) -> [P, heads, hd]: each row attends to
    the rows of its window, which lie within one chunk either side of its own."""
    n, (p, heads, hd) = q.shape[0] // chunk, q.shape

    def band(a: jax.Array, fill: int) -> jax.Array:  # [P, ...] -> [n, 3 * chunk, ...]
        pad = jnp.full((chunk,) + a.shape[1:], fill, a.dtype)
        a = jnp.concatenate([pad, a, pad]).reshape(n + 2, chunk, *a.shape[1:])
        return jnp.concatenate([a[:-2], a[1:-1], a[2:]], axis=1)

    keys, values = band(k, 0), band(v, 0)
    key_seg = band(seg, -2)  # the edges' fill: a segment no row has
    scores = jnp.einsum("nqhd,nkhd->nhqk", q.reshape(n, chunk, heads, hd), keys,
                        preferred_element_type=jnp.float32) * (hd ** -0.5)
    mask = seg.reshape(n, chunk)[:, :, None] == key_seg[:, None, :]
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("nhqk,nkhd->nqhd", probs, values).reshape(p, heads, hd)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q, k, v [P, heads, hd], mask [P, P] (the keys each row sees) -> [P, heads, hd]."""
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("hqk,khd->qhd", probs, v)


def full_attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
    """q, k, v [P, heads, hd], seg [P] (the image frame of each row) -> [P, heads, hd]: each row attends
    to its frame's rows, the keys scanned KEY_CHUNK at a time with an online softmax."""
    (p, heads, hd), chunk = q.shape, key_chunk(q.shape[0])
    n = p // chunk
    scale = hd ** -0.5

    def step(carry: tuple, block: tuple) -> tuple[tuple, None]:
        run_max, run_sum, acc = carry  # [heads, P], [heads, P], [heads, P, hd] (float32)
        kb, vb, sb = block
        s = jnp.einsum("qhd,khd->hqk", q, kb, preferred_element_type=jnp.float32) * scale
        s = jnp.where((seg[:, None] == sb[None, :])[None], s, -jnp.inf)
        new_max = jnp.maximum(run_max, s.max(axis=-1))
        # a row that has seen none of its keys yet keeps max -inf: exponents against 0 give 0, not NaN
        base = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(s - base[..., None])
        rescale = jnp.exp(run_max - base)
        acc = acc * rescale[..., None] + jnp.einsum("hqk,khd->hqd", probs.astype(vb.dtype), vb,
                                                    preferred_element_type=jnp.float32)
        return (new_max, run_sum * rescale + probs.sum(axis=-1), acc), None

    init = (jnp.full((heads, p), -jnp.inf, jnp.float32), jnp.zeros((heads, p), jnp.float32),
            jnp.zeros((heads, p, hd), jnp.float32))
    blocks = (k.reshape(n, chunk, heads, hd), v.reshape(n, chunk, heads, hd), seg.reshape(n, chunk))
    (_, total, acc), _ = jax.lax.scan(step, init, blocks)
    return (acc / total[..., None]).transpose(1, 0, 2).astype(v.dtype)
