"""Build a transformers fast tokenizer from a GGUF file's metadata, without torch.

transformers can convert a GGUF tokenizer itself, but its GGUF code imports
torch, which jaxserve does not depend on at run time. So we assemble the same
byte-level BPE with the `tokenizers` library from `tokenizer.ggml.*` fields and
wrap it in `PreTrainedTokenizerFast` (which brings chat templates); the tests
hold its ids against transformers' own conversion. The result is cached beside
the file (or under ~/.cache/jaxserve/gguf when that folder is read-only).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxserve.weights.gguf_file import cache_path, field, open_gguf

if TYPE_CHECKING:  # gguf is imported where a GGUF file is read (the GPU image lacks it)
    from gguf import GGUFReader

CONTROL, USER_DEFINED = 3, 4
# Pre-tokenizer split patterns for the `tokenizer.ggml.pre` values whose merges were not
# learned on GPT-2's split; anything else uses GPT-2's own (ByteLevel's built-in regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
          "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def load_gguf_tokenizer(reader: GGUFReader | None, path: Path) -> PreTrainedTokenizerFast:
    """The cached tokenizer of the GGUF file at `path`, else one built from `reader` and cached.

    reader None: the file is opened only on a cache miss (opening parses every header: seconds).
    """
    cache = cache_path(path, "tokenizer")
    if (cache / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(cache))
    tok = build_gguf_tokenizer(reader if reader is not None else open_gguf(path), path)
    try:
        tok.save_pretrained(str(cache))
    except OSError:
        pass  # a read-only place: rebuild next time, still correct
    return tok


def build_gguf_tokenizer(reader: GGUFReader, path: Path) -> PreTrainedTokenizerFast:
    kind = field(reader, "tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece (Gemma, Phi-3, Llama 2): weights/gguf_spm.py
        from jaxserve.weights.gguf_spm import build_spm_tokenizer

        return build_spm_tokenizer(path)
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer type {kind!r} is not supported yet (supported: 'gpt2' byte-level "
                         "BPE); use the model's HF-format directory instead")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    merges: list[str] = field(reader, "tokenizer.ggml.merges") or []
    token_types: list[int] = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                   fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""))
    split = SPLITS.get(field(reader, "tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, token_types) if ty == CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, token_types) if ty == USER_DEFINED])

    def special(key: str) -> str | None:
        idx = field(reader, f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        chat_template=field(reader, "tokenizer.chat_template"),
        add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        clean_up_tokenization_spaces=False,
    )
