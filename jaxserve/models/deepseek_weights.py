"""DeepSeek's attention tensors in float and block-wise FP8 checkpoints (DeepSeek-V3 / R1 as the hub
ships them: `quant_method: fp8`, `weight_block_size: [128, 128]`, each projection e4m3 [out, in]
with a float32 `weight_scale_inv` [cdiv(out, 128), cdiv(in, 128)]; the last block row / column
partial, e.g. kv_a_proj_with_mqa [576, 7168] with scales [5, 56]).

What the hub quantizes, and how it lands here:

    q_a_proj, q_b_proj (or q_proj), o_proj         fp8_block QuantizedWeights (assemble's `_proj` path)
    kv_a_proj_with_mqa                             fp8_block (its name lacks `_proj.weight`: read here)
    kv_b_proj                                      dequantized once at load into W_UK / W_UV (float):
                                                   the absorbed attention multiplies them into q and
                                                   the latent, never as a Linear (vLLM's MLA does the same)
    experts, shared experts, dense MLPs            fp8_block (moe_layers.quantized_experts, `_proj` path)
    norms, the router (mlp.gate), its bias,        float as stored
    embed_tokens, lm_head

Every reader here takes (get, prefix) for a float checkpoint and (get, prefix, linear) for a
quantized one (moe_layers.takes_linear; `linear` is hf_linear.linear_reader's).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxserve.models import mla
from jaxserve.models.config import ModelConfig
from jaxserve.models.moe_layers import takes_linear
from jaxserve.models.tensor_cuts import Cut, with_cuts
from jaxserve.quantization.qweight import QuantizedWeight

KV_A = "self_attn.kv_a_proj_with_mqa"
KV_B = "self_attn.kv_b_proj"


def kv_a_reader(cfg: ModelConfig) -> Callable:
    """wkv_a [hidden, R + rope]: the float weight transposed, or the checkpoint's fp8_block weight."""
    m = mla.mla(cfg)

    def read(get, prefix: str, linear=None):
        if linear is not None:
            return linear(prefix + KV_A, (cfg.hidden_size, m.cache_width))
        return np.asarray(get(prefix + KV_A + ".weight")).T
    shape = (m.cache_width, cfg.hidden_size)  # the weights API's name: the float tensor, [out, in]
    return with_cuts(takes_linear(read), lambda prefix: (Cut(prefix + KV_A + ".weight", shape, transpose=True),))


def kv_b_reader(cfg: ModelConfig, which: int) -> Callable:
    """kv_b_proj.weight [H * (nope + v), R] -> W_UK [H, nope, R] (which 0) or W_UV [H, v, R] (1), float
    (a block-wise FP8 checkpoint's values times their block scales, exactly as transformers dequantizes)."""
    m = mla.mla(cfg)

    def read(get, prefix: str, linear=None) -> np.ndarray:
        if linear is None:
            w = np.asarray(get(prefix + KV_B + ".weight"))
        else:
            w = host_dense(linear(prefix + KV_B, (m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim))))
        w = w.reshape(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim] if which == 0 else w[:, m.qk_nope_head_dim:]
    rows, nope = m.qk_nope_head_dim + m.v_head_dim, m.qk_nope_head_dim  # the weights API's name: kv_b_proj whole
    return with_cuts(takes_linear(read), lambda prefix: (Cut(
        prefix + KV_B + ".weight", (cfg.num_heads * rows, m.kv_lora_rank), view=(cfg.num_heads, rows, m.kv_lora_rank),
        axis=1, start=0 if which == 0 else nope, stop=nope if which == 0 else rows),))


def host_dense(w: QuantizedWeight) -> np.ndarray:
    """A host fp8_block weight [K, N] as float32 [N, K] (HF's [out, in]): each e4m3 value times its
    block's scale, the product qweight.dequantize computes on device."""
    if w.scheme != "fp8_block":
        raise ValueError(f"quantization: {w.scheme} checkpoints are not supported for kv_b_proj (only block-wise "
                         "fp8, as DeepSeek-V3's)")
    values = np.asarray(w.values).astype(np.float32)
    k, n = values.shape
    scales = np.repeat(np.repeat(np.asarray(w.scales, np.float32), w.group_size, 0), w.block_cols, 1)[:k, :n]
    return (values * scales).T
