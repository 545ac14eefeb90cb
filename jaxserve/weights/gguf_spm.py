"""A GGUF file's SentencePiece vocabulary (`tokenizer.ggml.model` = "llama": Gemma, Phi-3, Llama 2) as
a transformers fast tokenizer, built by transformers' own GGUF conversion (its tokenizer mapping,
which reads the file without torch and rebuilds the merges: Gemma's from the tokens' order), so the
ids are transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` ids by construction.

Gemma files carry no chat template as converted by older llama.cpp (gemma-3-270m's has none); llama.cpp
then applies its built-in Gemma template, and so do we: GEMMA_CHAT_TEMPLATE is that template (the
system message prefixed to the first user turn, the assistant named `model`, each turn closed by
`<end_of_turn>`), the one Google's tokenizer_config.json gives for text.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def build_spm_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The SentencePiece tokenizer of the GGUF file at `path` (its special tokens, BOS flag and chat
    template; Gemma's built-in template where the file has none)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (convert_gguf_tokenizer,
                                                                           get_gguf_tokenizer)
    except ImportError as e:  # transformers before its GGUF tokenizer mapping module
        raise ValueError(f"{path}: a SentencePiece GGUF tokenizer needs transformers' GGUF tokenizer "
                         f"conversion (transformers >= 5), which this install lacks ({e})") from None
    arch, tokenizer, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(arch, tokenizer)
    template = config.get("chat_template") or (GEMMA_CHAT_TEMPLATE if arch in GEMMA_ARCHITECTURES else None)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template, clean_up_tokenization_spaces=False,
        **{k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token",
                                  "add_eos_token") if config.get(k) is not None})
