"""What llama.cpp's GGUF files of Gemma 2 and Gemma 3 hold beyond a Llama file, and what llama.cpp
assumes where the file says nothing (weights/gguf_file.py asks this module).

    tensors     blk.N.post_attention_norm, ffn_norm (the pre-feed-forward norm), post_ffw_norm;
                every norm weight stored as 1 + w (convert_hf_to_gguf.py adds 1; transformers'
                GGUF loader subtracts it again, and so do we, so models/gemma.py forms 1 + w itself)
    attention   the scale is not in the file: llama.cpp takes head_dim ** -0.5, except for the 27B
                models (Gemma 2: 46 layers, Gemma 3: 62), which take (hidden / heads) ** -0.5
    gemma2      attn_logit_softcapping, final_logit_softcapping; sliding window on even layers
    gemma3      sliding window on five layers of six (il % 6 < 5); the sliding layers' RoPE base is
                10000 (not in the file), the global layers' is rope.freq_base, scaled as rope.scaling says
    stop token  `<end_of_turn>` ends a turn: llama.cpp stops on it (an end-of-generation token by its
                text); added to the EOS ids when the vocabulary has it
"""

from __future__ import annotations

from typing import Callable

import numpy as np

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# HF name under model.layers.{i}. -> GGUF name under blk.{i}., where Gemma's differs from Llama's
LAYER_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B, whose scale differs
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
LOCAL_ROPE_THETA = 10_000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
END_OF_TURN = "<end_of_turn>"

Field = Callable[..., object]  # gguf_file.field bound to the reader: (key, default=None) -> value


def layer_name(arch: str, hf_name: str) -> str | None:
    """Gemma's GGUF name for a layer tensor, or None where it is Llama's (or the file is not Gemma)."""
    return LAYER_NAMES.get(hf_name) if arch in ARCHITECTURES else None


def from_gguf(arch: str, gguf_name: str, w: np.ndarray) -> np.ndarray:
    """A tensor as the HF checkpoint holds it: Gemma's norm weights back from 1 + w to w."""
    return w - 1.0 if arch in ARCHITECTURES and gguf_name.endswith("norm.weight") else w


def config_fields(arch: str, field: Field, tokens: list[str]) -> dict:
    """Gemma's ModelConfig fields from the metadata and llama.cpp's fixed rules; `extra_eos_ids`: the
    ids to stop on beside the file's EOS. {} for any other architecture."""
    if arch not in ARCHITECTURES:
        return {}
    layers = int(field(f"{arch}.block_count"))
    hidden, heads = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    scalar = hidden // heads if layers == _27B_LAYERS[arch] else head_dim
    pattern = _SWA_PATTERN[arch]
    window = field(f"{arch}.attention.sliding_window")
    out: dict = {"attn_scale": float(scalar) ** -0.5,
                 "sliding_layers": tuple(i for i in range(layers) if i % pattern < pattern - 1) if window else None}
    if arch == "gemma2":
        for key, name in (("attn_logit_softcap", "attn_logit_softcapping"),
                          ("final_logit_softcap", "final_logit_softcapping")):
            cap = field(f"gemma2.{name}")
            out[key] = float(cap) if cap else None
    else:
        out["rope_local_theta"] = LOCAL_ROPE_THETA
    if END_OF_TURN in tokens:
        out["extra_eos_ids"] = (tokens.index(END_OF_TURN),)
    return out
