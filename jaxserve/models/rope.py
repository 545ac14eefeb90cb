"""Rotary position embeddings in the HF (rotate-half) convention, with llama3, linear, YaRN and LongRoPE
scaling, over the whole head or its first `partial_rotary_factor` part (Phi-4-mini)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.models import longrope
from jaxserve.models.config import ModelConfig


def rotary_dim(cfg: ModelConfig) -> int:
    """How many leading dims of each head rotate (transformers: int(head_dim * partial_rotary_factor))."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[rotary_dim // 2] float64 inverse frequencies, scaled as the config says."""
    dim = rotary_dim(cfg)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
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
    if cfg.rope_type == "yarn":
        return _yarn(cfg, inv)
    if cfg.rope_type == "longrope":
        return inv / longrope.factors(cfg)
    return inv


def _yarn(cfg: ModelConfig, inv: np.ndarray) -> np.ndarray:
    """YaRN (transformers' _compute_yarn_parameters): dimensions that rotate fewer than beta_slow times
    over the original context are interpolated (inv / factor), those rotating more than beta_fast
    times kept, a linear ramp between."""
    factor, old_len, beta_fast, beta_slow, truncate, _ = cfg.rope_scaling
    dim = rotary_dim(cfg)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return inv / factor * (1 - keep) + inv * keep


def attention_scale(cfg: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (YaRN's and LongRoPE's attention factor; 1 otherwise)."""
    if cfg.rope_type == "longrope":
        return longrope.attention_factor(cfg)
    return cfg.rope_scaling[5] if cfg.rope_type == "yarn" else 1.0


def mrope_positions(cfg: ModelConfig, positions: jnp.ndarray) -> jnp.ndarray:
    """M-RoPE (Qwen2-VL): positions [3, T] (time, height, width) -> [T, rotary_dim // 2], each rotary
    frequency's position: the first mrope_section[0] frequencies follow time, the next height, the rest width."""
    axis = np.repeat(np.arange(3), cfg.vision.mrope_section)
    return positions[axis].T


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray, scale: float = 1.0) -> jnp.ndarray:
    """x: [num_tokens, num_heads, head_dim]; positions: [num_tokens] i32, or [num_tokens, rotary_dim//2]
    (each frequency its own position: mrope_positions); inv_freq: [rotary_dim//2] f32;
    scale: attention_scale(cfg), multiplied into cos and sin as transformers does. A rotary_dim short
    of head_dim (partial_rotary_factor < 1) rotates the leading dims and passes the rest through."""
    rot = 2 * inv_freq.shape[0]
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], positions, inv_freq, scale), x[..., rot:]], axis=-1)
    per_token = positions.astype(jnp.float32)
    angles = (per_token[:, None] if positions.ndim == 1 else per_token) * inv_freq[None, :]  # [T, hd/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, hd/2]
    sin = jnp.sin(angles)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
