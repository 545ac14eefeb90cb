"""Tiny random DeepSeek V2 / V3 checkpoints saved by transformers' own classes, for tests/test_deepseek.py."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              max_position_embeddings=256, tie_word_embeddings=False)
CHECKPOINTS = {
    # V2-Lite's shape: q projected directly, softmax scores, group_limited_greedy, YaRN with mscale and
    # mscale_all_dim apart (the rotary attention factor and the softmax scale both away from 1)
    "v2": ("DeepseekV2Config", dict(
        num_hidden_layers=2, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5, first_k_dense_replace=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             mscale=0.9, mscale_all_dim=0.7, beta_fast=32.0, beta_slow=1.0))),
    # V3's shape: q_lora_rank, sigmoid scores with a (randomized) selection bias, 4 groups keeping 2,
    # renormalised and scaled, the first layer dense, YaRN as V3's; rotate-half rotary dims
    # (rope_interleave false: V2 above takes the interleaved pairs, as V3's hub checkpoints do)
    "v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, first_k_dense_replace=1, rope_interleave=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))),
}


def save_checkpoint(name: str, out: Path) -> Path:
    """CHECKPOINTS[name] at random, saved in bfloat16 (tests/moe_fixtures.save_model), V3's
    e_score_correction_bias randomized (transformers initializes it to zeros)."""
    import torch
    import transformers

    from tests.moe_fixtures import save_model

    def bias(model) -> None:
        for key, buf in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.3)

    cls_name, extra = CHECKPOINTS[name]
    return save_model(getattr(transformers, cls_name)(**COMMON, **extra), out, bias)
