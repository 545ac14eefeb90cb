"""Tiny random Mixture-of-Experts checkpoints saved by transformers' own classes (bfloat16 weights),
and transformers' float32 greedy tokens and their logprobs for them: the references of tests/test_moe*.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)
# name -> (config class, fields); every one has 8 experts so TP 2 splits them with and without EP
CHECKPOINTS = {
    # a dense layer between sparse ones (mlp_only_layers), top-k weights not renormalised
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, head_dim=32, mlp_only_layers=[1],
                                         norm_topk_prob=False)),
    # the shared expert with its sigmoid gate, renormalised top-k, decoder_sparse_step 1
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                         norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
}
# gpt-oss (its own test, tests/test_gpt_oss.py): 2 layers, sliding (window 8) then full, YaRN RoPE
GPT_OSS = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=256, tie_word_embeddings=False,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                    truncate=False, original_max_position_embeddings=64))
PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 250, 11, 64, 9, 30, 2, 77, 18, 100, 6, 41], [8], [200, 3, 77, 9, 64]]
MAX_TOKENS = 8
# the exact float32 configuration (worker/sizing.py)
EXACT = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})


def save_checkpoint(name: str, out: Path) -> Path:
    """A random model of CHECKPOINTS[name] saved with save_pretrained in bfloat16."""
    import torch
    import transformers

    cls_name, extra = CHECKPOINTS[name]
    return save_model(getattr(transformers, cls_name)(**COMMON, **extra), out)


def save_gpt_oss(out: Path) -> Path:
    """The GPT_OSS model saved in bfloat16, its attention sinks large enough to matter."""
    import torch
    import transformers

    def sinks(model) -> None:
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(torch.randn_like(p) * 2.0)

    return save_model(transformers.GptOssConfig(**GPT_OSS), out, sinks)


def save_model(cfg, out: Path, tweak=None) -> Path:
    """A random model of transformers config `cfg` saved with save_pretrained in bfloat16 (`tweak`:
    a last change to its float32 parameters, under no_grad)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger weights than the default init, so the logits are far from uniform
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
        if tweak is not None:
            tweak(model)
    model.to(torch.bfloat16).save_pretrained(out)
    save_word_tokenizer(out, cfg.vocab_size)
    return out


def save_word_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` words w0 .. w{n-1} (so the server takes text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(out)


def hf_greedy(path: Path, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS,
              **load_kw) -> list[list[int]]:
    """transformers' float32 greedy continuation of each prompt (the bfloat16 weights, widened;
    `load_kw`: more from_pretrained arguments, e.g. quantization_config)."""
    return hf_reference(path, prompts, max_tokens, **load_kw)[0]


def hf_reference(path: Path, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS,
                 **load_kw) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' float32 greedy tokens of each prompt and the logprob of each (log_softmax of one
    full-sequence forward: tests/logprob_parity.py)."""
    import torch
    import transformers

    from tests.logprob_parity import reference_logprobs

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager", **load_kw).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                 min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None)
            tokens.append(ids[0, len(p):].tolist())
            logprobs.append(reference_logprobs(model, p, tokens[-1]))
    return tokens, logprobs


def engine_greedy(engine, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return engine_run(engine, prompts, max_tokens)[0]


def engine_run(engine, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS,
               lora_request=None) -> tuple[list[list[int]], list[list[float]]]:
    """The engine's greedy tokens of each prompt (all in flight together) and the logprob of each
    (`lora_request`: every prompt through that adapter)."""
    from jaxserve.core.sampling_params import SamplingParams
    from tests.logprob_parity import generated_logprobs

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, lora_request=lora_request)
    done: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    outs = [done[str(i)] for i in range(len(prompts))]
    return [list(o.token_ids) for o in outs], [generated_logprobs(o) for o in outs]


def make_engine(path: Path, **kw):
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine

    base = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, kv_cache_memory=1 << 20,
                compilation_cache_dir="")
    args = EngineArgs(model=str(path), **{**base, **EXACT, **kw})
    return LLMEngine(args, progress=False)


def save_mxfp4(src: Path, out: Path) -> Path:
    """`src` (a bfloat16 gpt-oss checkpoint) in gpt-oss's hub layout: config.json's quantization_config
    {quant_method: mxfp4}, each layer's experts as gate_up_proj / down_proj `_blocks` u8 [E, N, K/32, 16]
    and `_scales` u8 [E, N, K/32] (the inverse of transformers' convert_moe_packed_tensors: every
    block of 32 weights rounded to e2m1 values times a power of two), the biases and the rest as they were."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    tensors = {}
    for name, arr in load_file(str(src / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_pack(np.asarray(arr, np.float32))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = arr
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def mxfp4_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [E, K, N] float -> (blocks u8 [E, N, K/32, 16], scales u8 [E, N, K/32]): per 32 weights along K
    the smallest power-of-two scale putting them within e2m1's +-6, each rounded to the nearest value."""
    from jaxserve.quantization.mxfp4 import FP4_VALUES

    e, k, n = w.shape
    groups = np.swapaxes(w, 1, 2).reshape(e, n, k // 32, 32)  # [E, N, G, 32]
    peak = np.abs(groups).max(axis=-1, keepdims=True)
    exp = np.where(peak > 0, np.ceil(np.log2(np.maximum(peak, 1e-30) / 6.0)), 0).astype(np.int32)
    lut = np.asarray(FP4_VALUES[:8], np.float32)  # the magnitudes; the sign is bit 3
    mag = np.abs(groups) / np.exp2(exp)
    code = np.abs(mag[..., None] - lut).argmin(axis=-1) | np.where(groups < 0, 8, 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)  # element 2i low, 2i + 1 high
    return blocks, (exp[..., 0] + 127).astype(np.uint8)
