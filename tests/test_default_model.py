"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers on PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import PROMPTS
from tests.paged_helpers import paged_logits

TIE_MARGIN = 1e-3


def test_config_read_from_gguf(jax_default_model):
    cfg = jax_default_model.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM", 30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.eos_token_ids == (2,)


def test_greedy_48_tokens_match_transformers(jax_default_model, hf_greedy, capsys):
    m = jax_default_model
    prompts = [hf_greedy[p][0] for p in PROMPTS]
    conts = [hf_greedy[p][1] for p in PROMPTS]
    ours = paged_logits(m.params, m.config, prompts, conts, block_size=16, num_blocks=64)
    near_ties = []
    for prompt, got in zip(PROMPTS, ours):
        ids, ref_tokens, ref_logits = hf_greedy[prompt]
        for step, tok in enumerate(ref_tokens):
            mine = int(np.argmax(got[step]))
            if mine == tok:
                continue
            top2 = np.sort(ref_logits[step])[-2:]
            assert top2[1] - top2[0] < TIE_MARGIN, (
                f"{prompt!r}: token {step} differs: jaxserve {mine}, transformers {tok} "
                f"(reference margin {top2[1] - top2[0]:.2e})")
            near_ties.append((prompt, step, mine, tok))
        rel = np.abs(got[: len(ref_tokens)] - ref_logits).max() / np.abs(ref_logits).max()
        assert rel < 1e-3, f"{prompt!r}: max relative logit difference {rel:.2e}"
    with capsys.disabled():
        print(f"\n{len(PROMPTS)} prompts x 48 greedy tokens; near-tie differences allowed: {near_ties or 'none'}")


def test_tokenizer_ids_match_transformers(jax_default_model, hf_default_tokenizer):
    ours = jax_default_model.tokenizer
    texts = PROMPTS + ["  two leading spaces\tand a tab\n\n", "日本語のテキスト 🙂 emoji ünïcödé",
                       "<|im_start|>user\nhello<|im_end|>\n", "don't stop 1234567 3.14159!!",
                       "def f(x):\n    return x ** 2  # square", ""]
    for text in texts:
        assert ours.encode(text) == hf_default_tokenizer.encode(text), text
        ids = hf_default_tokenizer.encode(text)
        assert ours.decode(ids) == hf_default_tokenizer.decode(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        hf_default_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id) == (hf_default_tokenizer.eos_token_id,
                                                      hf_default_tokenizer.bos_token_id)
