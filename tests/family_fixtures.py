"""Tiny random Phi-3, OLMo 2 and Granite checkpoints saved by transformers' own classes (bfloat16
weights, tests/moe_fixtures.save_model), each with the quirks its family exists for, and the Phi-3
one written again as llama.cpp's GGUF (`phi3`) by gguf's own writer and tensor-name map: the
references of tests/test_families.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# 4 heads and 2 kv heads (both split at TP 2), 2 layers; token ids 0..2 are pad / bos / eos
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
ORIGINAL = 16  # Phi-3's original_max_position_embeddings: prompts on both sides of it
CHECKPOINTS = {
    # Phi-4-mini's shape in small: LongRoPE (short and long factors far apart), RoPE over 3/4 of each
    # head (12 of 16 dims: 6 factors), tied embeddings
    "phi3": ("Phi3Config", dict(
        tie_word_embeddings=True, original_max_position_embeddings=ORIGINAL,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5], long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0]))),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False, rope_theta=500000.0)),
    # granite-3.x's four scalars, none of them 1 (the attention's scale far from head_dim ** -0.5)
    "granite": ("GraniteConfig", dict(tie_word_embeddings=True, embedding_multiplier=6.0, attention_multiplier=0.1,
                                      residual_multiplier=0.3, logits_scaling=4.0)),
}


def save_checkpoint(name: str, out: Path) -> Path:
    import transformers

    from tests.moe_fixtures import save_model

    cls_name, extra = CHECKPOINTS[name]
    return save_model(getattr(transformers, cls_name)(**{**COMMON, **extra}), out)


def write_gguf(src: Path, arch: str, out: Path) -> Path:
    """The checkpoint at `src` as llama.cpp's convert_hf_to_gguf.py writes it for `arch` (phi3, olmo2,
    granite: the metadata its converter class writes, names from gguf's own tensor map, q/k rows
    permuted where the converter permutes them (granite, a LlamaModel), F32 tensors), with a
    byte-level BPE vocabulary of the checkpoint's words so the file loads with its tokenizer."""
    import json

    import gguf
    from safetensors.numpy import load_file

    hp = json.loads((src / "config.json").read_text())
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    n_head, n_kv, n_layer = hp["num_attention_heads"], hp["num_key_value_heads"], hp["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
    if arch == "phi3":
        _phi3_metadata(w, hp, rope)
    if arch == "granite":  # the converter's renames: *_multiplier -> *_scale, logits_scaling -> logit_scale
        w.add_attention_scale(hp["attention_multiplier"])
        w.add_embedding_scale(hp["embedding_multiplier"])
        w.add_residual_scale(hp["residual_multiplier"])
        w.add_logit_scale(hp["logits_scaling"])
    words = [f"w{i}" for i in range(hp["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(words)
    w.add_token_types([1] * len(words))
    w.add_eos_token_id(hp["eos_token_id"])
    w.add_bos_token_id(hp["bos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layer)
    for name, arr in load_file(str(src / "model.safetensors")).items():
        arr = np.asarray(arr, np.float32)
        if arch == "granite" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_head if name.endswith("q_proj.weight") else n_kv  # LlamaModel.permute
            arr = arr.reshape(heads, 2, arr.shape[0] // heads // 2, arr.shape[1]).swapaxes(1, 2).reshape(arr.shape)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), arr)
    if arch == "phi3":
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _phi3_metadata(w, hp: dict, rope: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters / generate_extra_tensors' metadata."""
    import math

    orig, max_pos = hp["original_max_position_embeddings"], hp["max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hp["hidden_size"]) // hp["num_attention_heads"])
    w.add_sliding_window(hp.get("sliding_window") or 0)
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(max_pos / orig) / math.log(orig)))
