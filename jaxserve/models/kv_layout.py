"""The KV pool's two arrays for a model config: their shapes and bytes per token.

    per-head K and V (every family but MLA)   K, V  [L, num_kv_heads, blocks, block_size, head_dim]
    latent (DeepSeek's MLA, models/mla.py)    K     [L, 1, blocks, block_size, kv_lora_rank + qk_rope_head_dim]
                                              V     [L, 1, blocks, block_size, 0]   (holds nothing)

A latent pool keeps one entry per token per layer, the normed latent then the rotated key (576
values for V2/V3): attention reads it as the keys and its first kv_lora_rank values as the values
(one MQA head), so there is nothing for V to hold; it stays a zero-width array so the pool is
still the (K, V) pair every program (copies, swaps, the model step) passes around. The engine's
sizing and `jaxserve plan` read `bytes_per_token` (worker/sizing.py)."""

from __future__ import annotations

from jaxserve.models.config import ModelConfig

Shape = tuple[int, ...]


def pool_shapes(cfg: ModelConfig, num_blocks: int, block_size: int,
                num_layers: int | None = None) -> tuple[Shape, Shape]:
    """(K shape, V shape) of a pool of `num_blocks` blocks over `num_layers` layers (default: all)."""
    layers = cfg.num_layers if num_layers is None else num_layers
    if cfg.mla is not None:
        return (layers, 1, num_blocks, block_size, cfg.mla.cache_width), (layers, 1, num_blocks, block_size, 0)
    shape = (layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    return shape, shape


def latent_values_per_token(cfg: ModelConfig, num_layers: int) -> int | None:
    """Values one token holds in a latent pool over `num_layers` layers (the same on every TP device:
    the latent is shared by all heads, so the pool is replicated, as vLLM's and sglang's); None when
    the model keeps per-head K and V."""
    return None if cfg.mla is None else num_layers * cfg.mla.cache_width
