"""Rotary position embeddings in the HF (rotate-half) convention, with llama3 and linear scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float64 inverse frequencies, scaled as the config says."""
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    if cfg.rope_type == "linear":
        return inv / cfg.rope_scaling[0]
    if cfg.rope_type == "llama3":
        factor, low_ff, high_ff, old_len = cfg.rope_scaling
        low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        mid = (1 - smooth) * inv / factor + smooth * inv
        return np.where(wavelen > low_wavelen, inv / factor, np.where(wavelen < high_wavelen, inv, mid))
    return inv


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """x: [num_tokens, num_heads, head_dim]; positions: [num_tokens] i32; inv_freq: [head_dim//2] f32."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, hd/2]
    sin = jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
