"""Qwen2-VL's and Qwen2.5-VL's vision tower in JAX, as transformers' Qwen2VisionTransformerPretrainedModel
and Qwen2_5_VisionTransformerPretrainedModel compute it, over a ragged batch of images' patches.

    patches [N, C*T*P*P]  (the processor's flattened patches, each image's in 2x2-merge-block order)
      -> patch embedding: the Conv3d whose kernel equals its stride is one matmul over the flattened patch
      -> depth x block: x + attn(norm1(x)), x + mlp(norm2(x)); 2-D rotary on q, k (height, width)
      -> merger: norm, every 4 consecutive rows (a 2x2 block) concatenated, Linear -> GELU -> Linear
    -> [N / 4, out_hidden]: one language-model input row per merged block

Attention never forms a [N, N] matrix (models/vision/attention.py): the rows run in window order, as
transformers reorders them (each Qwen2.5-VL window's patches contiguous; Qwen2-VL: the processor's order),
a window block attends within chunks of the window's size and its neighbours, a full block (Qwen2-VL's,
Qwen2.5-VL's fullatt_block_indexes) scans key chunks with an online softmax under the image mask; the
rows go back to the processor's order before the merger. Memory is linear in N. Padding rows (segment
-1) see only each other and are dropped by the caller.

Params (weights [in, out]; the blocks stacked on a leading [depth] axis):
    patch [C*T*P*P, D]
    blocks/ norm1, norm2 [L, D] (+ norm1_b, norm2_b: LayerNorm), qkv [L, D, 3D], qkv_b [L, 3D], proj [L, D, D],
            proj_b [L, D], full [L] (1.0: full attention), and fc1, fc1_b, fc2, fc2_b (Qwen2-VL) or
            gate, gate_b, up, up_b, down, down_b (Qwen2.5-VL)
    merger/ norm [D] (+ norm_b), fc1 [4D, 4D], fc1_b, fc2 [4D, out], fc2_b
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.vision.attention import (KEY_CHUNK, dense_attention, full_attention, window_attention,
                                              window_blocks, window_chunk)
from jaxserve.models.vision.config import VisionConfig

TensorGetter = Callable[[str], np.ndarray]
NORM_EPS = 1e-6  # both towers' norms (transformers hard-codes it)


def _act(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.gelu(x, approximate=name == "gelu_pytorch_tanh")


def _norm(vc: VisionConfig, x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    """RMSNorm (Qwen2.5-VL: in float32, cast back, then scaled) or LayerNorm (Qwen2-VL)."""
    xf = x.astype(jnp.float32)
    if b is None:
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + NORM_EPS)
        return w * xf.astype(x.dtype)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + NORM_EPS) * w + b).astype(x.dtype)


def _rotary(vc: VisionConfig, pos_hw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [N, head_dim]: the first half of each rotated pair's frequencies follow the patch's row,
    the second its column (transformers' axial recomposition: [h freqs, w freqs] twice)."""
    spatial = vc.head_dim // 2
    inv = 1.0 / (vc.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))
    freqs = pos_hw.astype(jnp.float32)[:, :, None] * jnp.asarray(inv, jnp.float32)  # [N, 2, hd/4]
    freqs = jnp.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)  # [N, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, heads, hd] rotated (rotate-half), in float32 as transformers' apply_rotary_pos_emb_vision."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def _attention(vc: VisionConfig, lp: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, seg_full: jax.Array,
               seg_window: jax.Array) -> jax.Array:
    n, heads, hd = x.shape[0], vc.num_heads, vc.head_dim
    qkv = (x @ lp["qkv"] + lp["qkv_b"]).reshape(n, 3, heads, hd)
    q, k, v = _rope(qkv[:, 0], cos, sin), _rope(qkv[:, 1], cos, sin), qkv[:, 2]
    if n <= KEY_CHUNK:  # the scores fit the chunked forms' bound: one masked softmax, quicker to compile
        mask = seg_full[:, None] == seg_full[None, :]
        if vc.window_size:
            mask = jnp.where(lp["full"] > 0, mask, seg_window[:, None] == seg_window[None, :])
        out = dense_attention(q, k, v, mask)
    elif not vc.window_size:  # Qwen2-VL: every block attends over its image
        out = full_attention(q, k, v, seg_full)
    else:  # one branch runs: the block's own kind
        out = jax.lax.cond(lp["full"] > 0, lambda: full_attention(q, k, v, seg_full),
                           lambda: window_attention(q, k, v, seg_window, window_chunk(vc, n)))
    return out.reshape(n, heads * hd) @ lp["proj"] + lp["proj_b"]


def _mlp(vc: VisionConfig, lp: dict, x: jax.Array) -> jax.Array:
    if "gate" in lp:  # Qwen2.5-VL: SwiGLU with biases
        gate, up = x @ lp["gate"] + lp["gate_b"], x @ lp["up"] + lp["up_b"]
        return (_act(vc.hidden_act, gate) * up) @ lp["down"] + lp["down_b"]
    return _act(vc.hidden_act, x @ lp["fc1"] + lp["fc1_b"]) @ lp["fc2"] + lp["fc2_b"]


def vision_forward(params: dict, vc: VisionConfig, patches: jax.Array, order: jax.Array, pos_hw: jax.Array,
                   seg_full: jax.Array, seg_window: jax.Array) -> jax.Array:
    """patches [N, patch_dim] in the processor's order; order [N] i32 (the patch each row of the window
    layout takes), pos_hw [N, 2] i32 (row, column), seg_full / seg_window [N] i32 (the image frame, or the
    window, each row attends within; -1 padding), all three in the layout's order (patch_layout)
    -> merged rows [N / merge_unit, out_hidden] in the processor's order."""
    x = patches.astype(params["patch"].dtype) @ params["patch"]
    if vc.window_size:
        x = x[order]
    cos, sin = _rotary(vc, pos_hw)

    def block(x, lp):
        x = x + _attention(vc, lp, _norm(vc, x, lp["norm1"], lp.get("norm1_b")), cos, sin, seg_full, seg_window)
        return x + _mlp(vc, lp, _norm(vc, x, lp["norm2"], lp.get("norm2_b"))), None

    x, _ = jax.lax.scan(block, x, params["blocks"])
    if vc.window_size:  # back to the processor's order: each 2x2 block's four rows again consecutive
        x = jnp.zeros_like(x).at[order].set(x, unique_indices=True)
    m = params["merger"]
    x = _norm(vc, x, m["norm"], m.get("norm_b")).reshape(-1, vc.merge_unit * vc.hidden_size)
    x = jax.nn.gelu(x @ m["fc1"] + m["fc1_b"], approximate=False)  # torch's nn.GELU(): the exact erf form
    return x @ m["fc2"] + m["fc2_b"]


# ---- host side: the geometry of a batch of images --------------------------------------------------
def patch_layout(vc: VisionConfig, grids: list[tuple[int, int, int]],
                 num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(order [R], pos_hw [R, 2], seg_full [R], seg_window [R]) for images of (t, h, w) patch grids laid
    out one after another, padded to `num_rows` (segment -1, last). The processor gives each frame's
    patches as 2x2 merge blocks row by row, the block's patches row by row inside it; the layout (what
    `order` picks, and the order of the other three) puts each Qwen2.5-VL window's patches together, the
    windows of a frame row by row (transformers' window_index), keeping each block's four rows in order."""
    m = vc.spatial_merge_size
    win = window_blocks(vc)  # Qwen2.5-VL: a window is this many merged blocks a side
    pos, full, window = [], [], []
    frame = next_window = 0
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        hw = np.stack([a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols)], -1)
        block_r, block_c = hw[:, 0] // m, hw[:, 1] // m
        for _ in range(t):
            pos.append(hw)
            full.append(np.full(h * w, frame))
            frame += 1
            if win:
                wid = (block_r // win) * (-(-(w // m) // win)) + block_c // win
                window.append(wid + next_window)
                next_window += int(wid.max()) + 1
            else:
                window.append(full[-1])
    n = sum(len(p) for p in pos)
    if n > num_rows:
        raise ValueError(f"{n} patches exceed the {num_rows} rows of the vision program")
    order = np.arange(num_rows, dtype=np.int32)
    out_pos = np.zeros((num_rows, 2), np.int32)
    out_full = np.full(num_rows, -1, np.int32)
    out_window = np.full(num_rows, -1, np.int32)
    if pos:
        window_ids = np.concatenate(window)
        # window ids rise with the frame: a stable sort keeps frames, then windows, then the processor's order
        order[:n] = np.argsort(window_ids, kind="stable") if win else np.arange(n)
        out_pos[:n], out_full[:n] = np.concatenate(pos)[order[:n]], np.concatenate(full)[order[:n]]
        out_window[:n] = window_ids[order[:n]]
    return order, out_pos, out_full, out_window


# ---- weights ---------------------------------------------------------------------------------------
def read_vision_params(vc: VisionConfig, get: TensorGetter, dtype: jnp.dtype, prefix: str) -> dict:
    """The tower's params from the checkpoint's tensors under `prefix` ("visual." or "model.visual.")."""
    def t(name: str, transpose: bool = False) -> np.ndarray:
        arr = np.asarray(get(prefix + name), np.float32)
        return arr.T if transpose else arr

    names = {"norm1": "norm1.weight", "norm2": "norm2.weight", "qkv": "attn.qkv.weight", "qkv_b": "attn.qkv.bias",
             "proj": "attn.proj.weight", "proj_b": "attn.proj.bias"}
    if vc.kind == "qwen2_vl":
        names.update(norm1_b="norm1.bias", norm2_b="norm2.bias", fc1="mlp.fc1.weight", fc1_b="mlp.fc1.bias",
                     fc2="mlp.fc2.weight", fc2_b="mlp.fc2.bias")
    else:
        names.update({f"{p}{s}": f"mlp.{p}_proj.{'bias' if s else 'weight'}" for p in ("gate", "up", "down")
                      for s in ("", "_b")})
    linear = lambda name: name.endswith(".weight") and not name.startswith("norm")  # noqa: E731  [out, in]
    blocks = {leaf: np.stack([t(f"blocks.{i}.{name}", linear(name)) for i in range(vc.depth)])
              for leaf, name in names.items()}
    blocks["full"] = np.asarray([float(vc.window_size == 0 or i in vc.fullatt_block_indexes)
                                 for i in range(vc.depth)], np.float32)
    merger = {"norm": t("merger.ln_q.weight"), "fc1": t("merger.mlp.0.weight", True), "fc1_b": t("merger.mlp.0.bias"),
              "fc2": t("merger.mlp.2.weight", True), "fc2_b": t("merger.mlp.2.bias")}
    if vc.kind == "qwen2_vl":
        merger["norm_b"] = t("merger.ln_q.bias")
    patch = t("patch_embed.proj.weight").reshape(vc.hidden_size, vc.patch_dim).T
    tree = {"patch": patch, "blocks": blocks, "merger": merger}
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)
