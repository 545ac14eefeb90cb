"""Phi-3 (LongRoPE, partial rotary, fused projections), OLMo 2 (post-norms, whole-projection q/k norm)
and Granite 3 (its four scalars) against transformers: tiny random checkpoints saved by transformers'
own classes (tests/family_fixtures.py), greedy tokens equal to transformers' float32 ones and each
token's logprob within 1e-4 (tests/logprob_parity.py) under the exact float32 flags; Phi-3 with
prompts on both sides of original_max_position_embeddings, and again from a GGUF file written by
gguf's writer; OLMo 2 under TP 2 (fake CPU devices, tests/moe_worker.py); `jaxserve plan`'s sizing
of each family at its hub shape against transformers' own parameter count."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.worker_run import run_json_worker
from tests.family_fixtures import ORIGINAL, save_checkpoint, write_gguf
from tests.logprob_parity import assert_logprobs_close
from tests.moe_fixtures import PROMPTS, engine_run, hf_reference, make_engine

MAX_TOKENS = 8
LONG = [int(x) for x in np.random.default_rng(7).integers(3, 256, ORIGINAL + 4)]  # past the original length
STRADDLE = LONG[:10]  # 10 prompt + 8 generated: crosses the original length while generating
SHORT = LONG[20 - 5:]  # 5 + 8 tokens: within it


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: save_checkpoint(name, root / name) for name in ("phi3", "olmo2", "granite")}


# compile only the programs the prompts use (enforce_eager), all prompts prefilled in one step: one
# prefill and one decode shape of the model step
ENGINE = dict(enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=32)


def _engine(path: Path, **kw):
    return make_engine(path, **{**ENGINE, **kw})


def _hf(path: Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("name", ["olmo2", "granite"])
def test_one_device_greedy_equals_transformers(checkpoints, name):
    path = checkpoints[name]
    reference, ref_logprobs = hf_reference(path, PROMPTS, MAX_TOKENS)
    engine = _engine(path)
    try:
        cfg = engine.model.config
        if name == "olmo2":  # no pre-norms, post-norms, q/k norms over the whole projection
            layers = engine.model.params["layers"]
            assert "attn_norm" not in layers and {"attn_post_norm", "mlp_post_norm"} <= set(layers)
            assert layers["q_norm"].shape == (2, 64) and layers["k_norm"].shape == (2, 32)
        else:
            assert (cfg.embedding_multiplier, cfg.attn_scale, cfg.residual_multiplier, cfg.logits_scaling) == (
                6.0, 0.1, 0.3, 4.0)
        tokens, logprobs = engine_run(engine, PROMPTS, MAX_TOKENS)
    finally:
        engine.shutdown()
    assert tokens == reference
    assert_logprobs_close(logprobs, ref_logprobs, what=name)


def test_phi3_long_factors_past_the_original_length(checkpoints):
    """max_model_len 64 > original 16: every request uses the long factors (models/longrope.py). A
    prompt past 16 equals transformers' generate; one that crosses 16 while generating equals
    transformers' forward over its whole sequence (the long set throughout: no mixed cache), and
    differs from what the short set gives its first token."""
    import torch

    from jaxserve.models import longrope
    from tests.logprob_parity import reference_logprobs

    path = checkpoints["phi3"]
    reference, ref_logprobs = hf_reference(path, [LONG], MAX_TOKENS)
    engine = _engine(path)
    try:
        cfg = engine.model.config
        assert longrope.uses_long(cfg) and cfg.partial_rotary_factor == 0.75 and cfg.tie_word_embeddings
        tokens, logprobs = engine_run(engine, [LONG, STRADDLE], MAX_TOKENS)
    finally:
        engine.shutdown()
    assert tokens[0] == reference[0]
    assert_logprobs_close(logprobs[:1], ref_logprobs, what="phi3 long prompt")
    hf = _hf(path)
    with torch.no_grad():  # one forward over prompt + generated (18 > 16 positions: the long set)
        logits = hf(input_ids=torch.tensor([STRADDLE + tokens[1]])).logits[0, len(STRADDLE) - 1:-1]
    assert logits.argmax(-1).tolist() == tokens[1]
    assert_logprobs_close(logprobs[1:], [reference_logprobs(hf, STRADDLE, tokens[1])], what="phi3 straddling")
    short_first = reference_logprobs(hf, STRADDLE, tokens[1][:1])[0]  # 11 positions: the short set
    assert abs(short_first - logprobs[1][0]) > 1e-3


def test_phi3_lora_on_the_fused_projections_equals_peft(checkpoints, tmp_path):
    """PEFT adapts Phi-3's fused qkv_proj and gate_up_proj as they are (one A, one B over the fused rows):
    served, the adapter gives peft's greedy tokens and logprobs. Within the original length (max_model_len 16):
    the short LongRoPE set in both (models/longrope.py)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from jaxserve.lora.request import LoRARequest
    from tests.logprob_parity import reference_logprobs

    torch.manual_seed(0)
    model = get_peft_model(_hf(checkpoints["phi3"]), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zeros: random, so the adapter changes the output
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(str(tmp_path / "adapter"))
    prompts, tokens, ref_logprobs = [PROMPTS[2], PROMPTS[1], LONG[:8]], [], []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            tokens.append(ids[0, len(p):].tolist())
            ref_logprobs.append(reference_logprobs(model, p, tokens[-1]))
    engine = _engine(checkpoints["phi3"], enable_lora=True, max_lora_rank=8, max_loras=1, max_model_len=ORIGINAL)
    try:
        base, _ = engine_run(engine, prompts, MAX_TOKENS)
        got, logprobs = engine_run(engine, prompts, MAX_TOKENS, LoRARequest("fused", 1, str(tmp_path / "adapter")))
    finally:
        engine.shutdown()
    assert got == tokens and got != base
    assert_logprobs_close(logprobs, ref_logprobs, what="phi3 lora")


def test_phi3_gguf_short_factors_within_the_original_length(checkpoints, tmp_path):
    """The checkpoint written as llama.cpp's phi3 GGUF (fused attn_qkv / ffn_up, rope_factors_* tensors)
    reads to the same config and weights as the directory; served with max_model_len 16 (the short
    factors), a prompt within the original length gives transformers' tokens and logprobs."""
    import jax

    from jaxserve.models import longrope
    from jaxserve.weights.loader import load_model

    path = checkpoints["phi3"]
    gguf_path = write_gguf(path, "phi3", tmp_path / "phi3.gguf")
    hf_dir, from_gguf = (load_model(str(p), dtype="float32", progress=False) for p in (path, gguf_path))
    a, b = hf_dir.config, from_gguf.config
    assert b.architecture == "Phi3ForCausalLM" and b.rope_type == "longrope" and b.partial_rotary_factor == 0.75
    np.testing.assert_allclose(b.rope_scaling, a.rope_scaling, rtol=1e-6)  # float32 in the file
    assert (b.head_dim, b.tie_word_embeddings, b.sliding_window) == (a.head_dim, True, None)
    jax.tree.map(np.testing.assert_array_equal, from_gguf.params, hf_dir.params)

    reference, ref_logprobs = hf_reference(path, [SHORT], MAX_TOKENS)
    engine = _engine(gguf_path, max_model_len=ORIGINAL)
    try:
        assert not longrope.uses_long(engine.model.config)
        tokens, logprobs = engine_run(engine, [SHORT], MAX_TOKENS)
    finally:
        engine.shutdown()
    assert tokens == reference
    assert_logprobs_close(logprobs, ref_logprobs, what="phi3 gguf short prompt")


@pytest.mark.parametrize("name", ["olmo2", "granite"])
def test_gguf_reads_the_checkpoints_config_and_weights(checkpoints, tmp_path, name):
    """OLMo 2 and Granite written as llama.cpp's converter writes them (olmo2's post-norm names,
    granite's *_scale metadata and permuted q/k rows) load to the directory's config and weights,
    so serve the tokens the tests above hold against transformers."""
    import dataclasses

    import jax

    from jaxserve.weights.loader import load_model

    path = checkpoints[name]
    gguf_path = write_gguf(path, name, tmp_path / f"{name}.gguf")
    hf_dir, from_gguf = (load_model(str(p), dtype="float32", progress=False) for p in (path, gguf_path))
    got, want = dataclasses.asdict(from_gguf.config), dataclasses.asdict(hf_dir.config)
    floats = [k for k, v in want.items() if isinstance(v, float)]  # float32 in the file
    np.testing.assert_allclose([got.pop(k) for k in floats], [want.pop(k) for k in floats], rtol=1e-6)
    assert got == want
    jax.tree.map(np.testing.assert_array_equal, from_gguf.params, hf_dir.params)


@pytest.mark.multidevice
def test_olmo2_tensor_parallel_greedy_equals_transformers(checkpoints):
    """TP 2: q and k split by heads, their RMSNorm still over the whole projection (the sum of
    squares across both shards), the tokens and logprobs of transformers."""
    path = checkpoints["olmo2"]
    reference, ref_logprobs = hf_reference(path, PROMPTS, MAX_TOKENS)
    options = json.dumps({"settings": {"olmo2": [[2, 1, False]]}, "prompts": PROMPTS, "engine": ENGINE})
    r = run_json_worker("moe_worker", "--options", options, str(path), devices=2)["olmo2/tp2/pp1"]
    assert r["tokens"] == reference
    assert_logprobs_close(r["logprobs"], ref_logprobs, what="olmo2 tp2")


# hub configs (their config.json fields that shape the weights); the LongRoPE factors are placeholders
HUB = {
    "Phi-3-mini-128k": dict(architectures=["Phi3ForCausalLM"], vocab_size=32064, hidden_size=3072,
                            intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=32, max_position_embeddings=131072,
                            original_max_position_embeddings=4096, tie_word_embeddings=False,
                            rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=[2.0] * 48)),
    "Phi-4-mini": dict(architectures=["Phi3ForCausalLM"], vocab_size=200064, hidden_size=3072,
                       intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                       max_position_embeddings=131072, original_max_position_embeddings=4096,
                       partial_rotary_factor=0.75, tie_word_embeddings=True,
                       rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=[2.0] * 48)),
    "OLMo-2-1124-7B": dict(architectures=["Olmo2ForCausalLM"], vocab_size=100352, hidden_size=4096,
                           intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=32, max_position_embeddings=4096, rope_theta=500000,
                           tie_word_embeddings=False),
    "granite-3.1-8b": dict(architectures=["GraniteForCausalLM"], vocab_size=49155, hidden_size=4096,
                           intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32,
                           num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=True,
                           embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                           logits_scaling=16.0),
}


@pytest.mark.parametrize("name", sorted(HUB))
def test_plan_counts_transformers_parameters(name):
    """`jaxserve plan`'s parameter count of each family at a hub model's shape equals transformers'
    count of the same config (built on the meta device: no memory), and TP 2 halves the weights."""
    import torch
    import transformers

    from jaxserve.models.config import ModelConfig
    from jaxserve.plan.estimate import total_params
    from jaxserve.worker import sizing

    hf = HUB[name]
    cfg = ModelConfig.from_hf(hf)
    model_type = {"Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2", "GraniteForCausalLM": "granite"}
    config = transformers.AutoConfig.for_model(model_type[hf["architectures"][0]],
                                               **{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert total_params(cfg) == model.num_parameters()
    one = sizing.weight_bytes_per_device(cfg, 2)
    assert one == 2 * total_params(cfg)
    # at TP 2 half of every weight, but the vocabulary tables where the vocabulary is odd (granite's 49155)
    tables = 2 * cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    half = one / 2 + (tables / 2 if cfg.vocab_size % 2 else 0)
    assert abs(sizing.weight_bytes_per_device(cfg, 2, 2) - half) < one * 0.01


PHI3 = dict(architectures=["Phi3ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
            original_max_position_embeddings=16, rope_scaling=dict(type="su", short_factor=[1.0] * 8,
                                                                   long_factor=[2.0] * 8))


@pytest.mark.parametrize("change, field", [
    (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 7, long_factor=[2.0] * 8)), "short_factor"),
    (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 8)), "long_factor"),
    (dict(original_max_position_embeddings=None), "original_max_position_embeddings"),
    (dict(partial_rotary_factor=1.5, rope_scaling=None), "partial_rotary_factor"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(architectures=["GraniteForCausalLM"], residual_multiplier=-1.0, rope_scaling=None), "residual_multiplier"),
    (dict(architectures=["GraniteForCausalLM"], mlp_bias=True, rope_scaling=None), "mlp_bias"),
])
def test_bad_config_names_the_field(change, field):
    from jaxserve.models import longrope
    from jaxserve.models.config import ModelConfig

    cfg = ModelConfig.from_hf(PHI3)  # the valid base: su is LongRoPE's first name; 64 > 16: the long set
    assert cfg.rope_type == "longrope" and longrope.uses_long(cfg)
    assert not longrope.uses_long(longrope.for_max_model_len(cfg, 16))
    assert longrope.uses_long(longrope.for_max_model_len(cfg, 17))
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf({k: v for k, v in {**PHI3, **change}.items() if v is not None})
