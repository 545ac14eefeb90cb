"""Tiny random Qwen2.5-VL and Qwen2-VL checkpoints saved by transformers' own classes, with the image
processor (Qwen2VLImageProcessorPil, the class AutoImageProcessor loads without torchvision) and a
byte-level BPE tokenizer holding Qwen's special tokens (<|vision_start|>, <|image_pad|>, ...) beside
them, and transformers' float32 greedy continuations of image+text prompts: the references of
tests/test_qwen2_vl.py."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
VOCAB = 272  # 256 byte tokens, the specials at 256.., room to spare
IDS = {t: 256 + i for i, t in enumerate(SPECIAL)}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=IDS["<|endoftext|>"],
            eos_token_id=IDS["<|im_end|>"], pad_token_id=IDS["<|endoftext|>"],
            # head_dim 16: 8 frequencies split time / height / width (Qwen's 16/24/24 of 64, in small)
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
TOKEN_IDS = dict(image_token_id=IDS["<|image_pad|>"], video_token_id=IDS["<|video_pad|>"],
                 vision_start_token_id=IDS["<|vision_start|>"], vision_end_token_id=IDS["<|vision_end|>"])
# Qwen2.5-VL: RMSNorm + SwiGLU blocks, windows of 2x2 merged patches (56 px) but in block 1
VISION_25 = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
                 fullatt_block_indexes=[1], hidden_act="silu", patch_size=14, temporal_patch_size=2,
                 spatial_merge_size=2, in_channels=3)
# Qwen2-VL: LayerNorm + quick-GELU MLP blocks, full attention over each image
VISION_2 = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, hidden_act="quick_gelu",
                patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64


def save_vl_checkpoint(kind: str, out: Path) -> Path:
    """`kind` "qwen2_5_vl" or "qwen2_vl": the model (float32 weights, larger than the default init so
    the logits are far from uniform), its tokenizer and image processor, saved to `out`."""
    import torch
    import transformers

    if kind == "qwen2_5_vl":
        cfg = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION_25, **TOKEN_IDS)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        cfg = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=VISION_2, **TOKEN_IDS)
        cls = transformers.Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    save_tokenizer(out)
    transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out)
    return out


def save_tokenizer(out: Path) -> None:
    """Byte-level BPE over the 256 bytes (no merges), Qwen's special tokens at 256.., a ChatML template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    assert [tok.token_to_id(t) for t in SPECIAL] == list(IDS.values())
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


# Qwen2-VL's template, shortened: image parts become <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def image(height: int, width: int, seed: int):
    """A random RGB Pillow image."""
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def hf_generate(path: Path, prompt: str, images: list, max_tokens: int) -> tuple[list[int], list[int], list[float]]:
    """transformers' float32 greedy continuation of one prompt ("<|image_pad|>" once per image, expanded
    here as Qwen's processor expands it): (prompt ids, generated ids, each generated token's logprob from
    one teacher-forced forward over prompt + generated ids, as tests/logprob_parity.py takes them)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    kw = {}
    if images:
        proc = transformers.AutoImageProcessor.from_pretrained(path)
        kw = dict(proc(images=images, return_tensors="np"))
        counts = iter([int(np.prod(g)) // proc.merge_size ** 2 for g in kw["image_grid_thw"]])
        parts = prompt.split("<|image_pad|>")
        prompt = parts[0] + "".join("<|image_pad|>" * next(counts) + p for p in parts[1:])
        kw = {k: torch.from_numpy(np.asarray(v)) for k, v in kw.items()}
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=_types(ids),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=IDS["<|endoftext|>"],
                             eos_token_id=None, **kw)
        new = out[0, ids.shape[1]:].tolist()
        logits = model(input_ids=out, mm_token_type_ids=_types(out), **kw).logits[0].float()
    steps = torch.log_softmax(logits[ids.shape[1] - 1:-1], dim=-1)
    return ids[0].tolist(), new, steps[torch.arange(len(new)), torch.tensor(new)].tolist()


def _types(ids):
    return (ids == IDS["<|image_pad|>"]).int()  # transformers' mm_token_type_ids: 1 on image rows


@functools.lru_cache(maxsize=2)
def hf_model(path: Path):
    """transformers' float32 model of the checkpoint at `path` (eager attention)."""
    import json

    import torch
    import transformers

    cls = getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
