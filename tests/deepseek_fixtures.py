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
    # V2 with q_lora_rank (q through q_a / its norm / q_b, as V2 proper has) and V2's other router:
    # softmax scores, plain greedy top-k (no groups), no renormalisation; a dense first layer, plain RoPE
    "v2_q_lora": ("DeepseekV2Config", dict(
        num_hidden_layers=2, q_lora_rank=24, topk_method="greedy", routed_scaling_factor=1.0,
        first_k_dense_replace=1)),
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


# A V3 whose projections span whole and partial 128 x 128 blocks, as the hub's do (kv_a_proj_with_mqa
# [576, 7168]: 4.5 block rows): hidden 192 = 1.5 blocks, kv_a [144 + 16, 192], q_a [160, 192],
# experts [160, 192]; the first layer dense
FP8_V3 = dict(vocab_size=256, hidden_size=192, num_attention_heads=4, num_key_value_heads=4, intermediate_size=320,
              moe_intermediate_size=160, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              kv_lora_rank=144, q_lora_rank=160, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
              num_hidden_layers=3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
              first_k_dense_replace=1, max_position_embeddings=256, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                   original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
                                   beta_fast=32.0, beta_slow=1.0))
# DeepSeek-V3's config.json
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# the Linears the hub's V3 stores in e4m3 (not the norms, mlp.gate, embed_tokens or lm_head)
FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj")
# V3's multi-token-prediction layer's own tensors (model.layers.{num_hidden_layers}.*, bfloat16 in the hub's
# checkpoint: vLLM's DeepSeekMTP reads eh_proj as a plain Linear), beside a decoder layer's
MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
               "embed_tokens.weight")


def block_fp8(w, block: int = 128):
    """One Linear [out, in] in e4m3 with a float32 scale per block x block tile (the last row and column
    of tiles partial, cdiv layout), as DeepSeek's hub checkpoints: (values e4m3, weight_scale_inv
    [cdiv(out, b), cdiv(in, b)], the dequantized float32 weight values * scale_inv). The scale is
    transformers' Fp8Quantize's (448 / the tile's max |w|), which only takes whole tiles."""
    import torch

    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = w.float()
    tiles = padded.reshape(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    values = (tiles * scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = (1.0 / scale).float()
    dense = (values.float() * scale_inv[:, None, :, None]).reshape(rows * block, cols * block)[:n, :k].contiguous()
    return values.reshape(rows * block, cols * block)[:n, :k].contiguous(), scale_inv, dense


def save_fp8_v3(out: Path, mtp: bool = True) -> tuple[Path, Path]:
    """A random FP8_V3 model saved by transformers, then in the hub's block-wise FP8 layout (out/fp8:
    FP8_LINEARS e4m3 + weight_scale_inv, FP8_CONFIG; with `mtp`, num_nextn_predict_layers 1 and a
    model.layers.3 as V3's layer 61: a copy of layer 2 plus MTP_TENSORS) and its dequantized float32
    twin for transformers (out/dense). -> (fp8 dir, dense dir)."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    def bias(model) -> None:
        for key, buf in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.3)

    from tests.moe_fixtures import save_model

    src = save_model(transformers.DeepseekV3Config(**FP8_V3, rope_interleave=False), out / "bf16", bias)
    tensors = load_file(src / "model.safetensors")
    n = FP8_V3["num_hidden_layers"]
    if mtp:
        g = torch.Generator().manual_seed(1)
        tensors.update({k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in tensors.items()
                        if k.startswith(f"model.layers.{n - 1}.")})
        h, vocab = FP8_V3["hidden_size"], FP8_V3["vocab_size"]
        shapes = {"eh_proj.weight": (h, 2 * h), "shared_head.head.weight": (vocab, h),
                  "embed_tokens.weight": (vocab, h)}
        for name in MTP_TENSORS:
            tensors[f"model.layers.{n}.{name}"] = torch.randn(shapes.get(name, (h,)), generator=g).to(torch.bfloat16)
    fp8, dense = {}, {}
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in FP8_LINEARS:
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"], dense[name] = block_fp8(w)
        else:
            fp8[name], dense[name] = w, w.float()
    cfg = json.loads((src / "config.json").read_text())
    for sub, weights, extra in (("fp8", fp8, {"quantization_config": FP8_CONFIG}), ("dense", dense, {})):
        (out / sub).mkdir(parents=True, exist_ok=True)
        save_file({k: v for k, v in weights.items() if sub == "fp8" or not k.startswith(f"model.layers.{n}.")},
                  out / sub / "model.safetensors", metadata={"format": "pt"})
        conf = {**cfg, **extra, "num_nextn_predict_layers": int(mtp) if sub == "fp8" else 0}
        (out / sub / "config.json").write_text(json.dumps(conf))
        for f in src.iterdir():  # the tokenizer
            if f.name.startswith(("tokenizer", "special_tokens")):
                (out / sub / f.name).write_bytes(f.read_bytes())
    return out / "fp8", out / "dense"
