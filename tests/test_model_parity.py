"""Logit parity with HF transformers (PyTorch, float32) for tiny random models of each family.

Each config is made with transformers, randomly initialised, saved with
`save_pretrained`, and loaded back by jaxserve from the directory; the logits of
a ragged prefill of three prompts and several batched decode steps through the
paged cache must match transformers' full-sequence forward.
"""

from __future__ import annotations

import numpy as np
import pytest

import torch
import transformers

from jaxserve.weights.loader import load_model  # noqa: E402
from tests.paged_helpers import paged_logits  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=256)

FAMILIES = {
    "llama2_mha": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3_gqa": ("LlamaConfig", dict(num_key_value_heads=2, rope_theta=500000.0)),
    "llama31_rope_scaling": ("LlamaConfig", dict(
        num_key_value_heads=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0)),
    "mistral_sliding": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=6)),
    "qwen2_bias_tied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qknorm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
}


def make_hf_model(family: str, tmp_path):
    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger weights than the default init, so the logits are far from uniform
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    hf = make_hf_model(family, tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", progress=False)
    cfg = loaded.config
    assert cfg.family == FAMILIES[family][0].removesuffix("Config").lower()
    # The feature each family exists to test must have survived the round trip through config.json.
    expected = {"llama31_rope_scaling": cfg.rope_type == "llama3", "mistral_sliding": cfg.sliding_window == 6,
                "qwen2_bias_tied": cfg.attention_bias and cfg.tie_word_embeddings,
                "qwen3_qknorm": cfg.qk_norm and cfg.head_dim == 32, "llama2_mha": cfg.num_kv_heads == 4,
                "llama3_gqa": cfg.num_kv_heads == 2 and cfg.rope_theta == 500000.0}
    assert expected[family], cfg
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (11, 1, 7)]
    conts = [rng.integers(0, 256, 5).tolist() for _ in prompts]
    ours = paged_logits(loaded.params, loaded.config, prompts, conts, block_size=4)
    for p, c, got in zip(prompts, conts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p + c])).logits[0].numpy()
        ref = ref[len(p) - 1:]  # the last prompt position and each continuation position
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, f"{family}: max relative logit difference {rel:.2e}"


def test_bf16_dots_from_a_token_count(tmp_path):
    """The CPU's --dtype auto (llama.run_layers' bf16_dots_from): a batch of at least that many tokens
    takes every projection as a bfloat16 x bfloat16 dot accumulated in float32, close to float32;
    a smaller batch is the float32 program itself, bit for bit."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import llama
    from jaxserve.models.attention import AttentionMetadata, make_kv_cache
    from jaxserve.quantization.matmul import matmul

    x = jax.random.normal(jax.random.PRNGKey(0), (5, 64), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 48), jnp.float32)
    rounded = x.astype(jnp.bfloat16).astype(jnp.float32) @ w.astype(jnp.bfloat16).astype(jnp.float32)
    got = matmul(x, w, jnp.bfloat16)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, rounded, rtol=1e-5, atol=1e-5)  # exact products, float32 sums
    assert not np.array_equal(got, x @ w)
    # int8 weights (--quantization int8): x in bfloat16 times the int8 values, exact in bfloat16, then
    # the scales (W8A16), instead of quantizing x too (W8A8)
    from jaxserve.quantization.qweight import dequantize
    from jaxserve.quantization.quantize import quantize_weight

    q = quantize_weight(w, "int8")
    w8a16 = (x.astype(jnp.bfloat16).astype(jnp.float32) @ q.values.astype(jnp.float32)) * q.scales[0]
    np.testing.assert_allclose(matmul(x, q, jnp.bfloat16), w8a16, rtol=1e-5, atol=1e-5)
    assert not np.allclose(matmul(x, q), w8a16, rtol=1e-5, atol=1e-5)  # W8A8 quantizes x as well
    np.testing.assert_allclose(matmul(x, q, jnp.bfloat16), x @ dequantize(q), rtol=0.05, atol=0.05)

    make_hf_model("qwen2_bias_tied", tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", progress=False)
    params, cfg = loaded.params, loaded.config

    def run(t: int, dots_from: int):
        ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, t), jnp.int32)
        md = AttentionMetadata(jnp.arange(t, dtype=jnp.int32), jnp.asarray([t], jnp.int32),
                               jnp.arange(t // 4, dtype=jnp.int32)[None], jnp.asarray([0, t], jnp.int32),
                               jnp.asarray([1], jnp.int32))
        kv = make_kv_cache(cfg.num_layers, cfg.num_kv_heads, t // 4, 4, cfg.head_dim, jnp.float32)
        fwd = jax.jit(lambda p, kv: llama.forward(p, cfg, kv, ids, jnp.arange(t, dtype=jnp.int32), md,
                                                  bf16_dots_from=dots_from)[1])
        return np.asarray(fwd(params, kv)), fwd.lower(params, kv).as_text()

    small, small_hlo = run(8, 16)
    assert np.array_equal(small, run(8, 0)[0]) and "bf16" not in small_hlo
    big, big_hlo = run(16, 16)
    ref, ref_hlo = run(16, 0)
    assert "bf16" in big_hlo and "bf16" not in ref_hlo
    assert not np.array_equal(big, ref)
    rel = np.abs(big - ref).max() / np.abs(ref).max()
    assert rel < 2e-2, rel  # bfloat16's 8 mantissa bits, through 3 layers of large random weights
