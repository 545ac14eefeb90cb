"""Tiny random Gemma 2 and Gemma 3 text checkpoints saved by transformers' own classes (bfloat16 weights),
and the same models written to GGUF as llama.cpp's convert_hf_to_gguf.py writes them: the references
of tests/test_gemma.py."""

from __future__ import annotations

import json
from pathlib import Path

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, sliding_window=8, tie_word_embeddings=True)
# Gemma 2: sliding (window 8, shorter than the long prompt) then global; q.k scaled by 24 ** -0.5, not
# head_dim's 16 ** -0.5; caps small enough that tanh bends the scores and the logits
GEMMA2 = dict(COMMON, num_hidden_layers=2, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
              final_logit_softcapping=6.0)
# Gemma 3: six layers (five sliding, one global, transformers' default layer_types), local RoPE base 100
# against global 10000 with linear scaling 4 on the global layer, no soft caps
GEMMA3 = dict(COMMON, num_hidden_layers=6, query_pre_attn_scalar=16,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})
CONFIGS = {"gemma2": ("Gemma2Config", GEMMA2), "gemma3": ("Gemma3TextConfig", GEMMA3)}
# longer than the window (8) and one step's token budget (16), a one-token prompt, a short one
PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 250, 11, 64, 9, 30, 2, 77, 18, 100, 6, 41, 12, 13, 14, 15], [8],
           [200, 3, 77, 9, 64]]
MAX_TOKENS = 8


def save_gemma(name: str, out: Path, **overrides) -> Path:
    """CONFIGS[name] (with `overrides`) as a random model saved by save_pretrained in bfloat16."""
    import transformers

    from tests.moe_fixtures import save_model

    cls_name, fields = CONFIGS[name]
    return save_model(getattr(transformers, cls_name)(**{**fields, **overrides}), out)


def write_gemma_gguf(src: Path, out: Path) -> Path:
    """The checkpoint at `src` as llama.cpp's convert_hf_to_gguf.py writes Gemma 2 / 3 (float32 tensors):
    its tensor names, every norm weight stored as 1 + w, the soft caps and window as metadata, and a
    word-level vocabulary (tokens w0..w{n-1}, gpt2 model, no merges) so the engine has a tokenizer."""
    import gguf
    from safetensors.torch import load_file

    hf = json.loads((src / "config.json").read_text())
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[hf["model_type"]]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_sliding_window(hf["sliding_window"])
    w.add_vocab_size(hf["vocab_size"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        w.add_rope_freq_base(hf.get("rope_parameters", {}).get("rope_theta", 10000.0))
    else:  # llama.cpp: the global base and scaling in the file, the local base fixed at 10000
        full = hf["rope_parameters"]["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"w{i}" for i in range(hf["vocab_size"])])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, arr in load_file(str(src / "model.safetensors")).items():
        arr = arr.float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + 1  # convert_hf_to_gguf.py: Gemma's norms are stored as 1 + w
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{names[rest.removesuffix('.weight')]}.weight"
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
