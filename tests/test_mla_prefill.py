"""DeepSeek's expanded MLA prefill (models/mla_prefill.py): K and V up-projected from the latent pool chunk
by chunk, merged by log-sum-exp. The tiny V2 (tests/deepseek_fixtures.py) served with the expanded path
forced on equals transformers' float32 greedy tokens over prefills whose cached prefix spans several
chunks (16-position chunks here); one layer of the tiny V2 and V3 gives the absorbed path's output within
1e-5 (float32) over a ragged step; the rule that picks the path; and the latent pool's ~9x tokens
against the expanded layout at DeepSeek-V2-Lite's shape."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import mla_prefill
from jaxserve.models.attention import AttentionMetadata
from jaxserve.models.config import ModelConfig
from tests.deepseek_fixtures import save_checkpoint
from tests.logprob_parity import assert_logprobs_close
from tests.moe_fixtures import engine_run, hf_reference, make_engine

LONG = [(7 * i + 3) % 250 + 1 for i in range(40)]
# LONG's first 32 tokens (2 blocks, 2 chunks) cached when it is sent after LONG: 6 new tokens over them
CACHED = LONG[:32] + [3, 1, 4, 1, 5, 9]

MLA_LEAVES = ("wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "w_uk", "w_uv", "wo")
# deepseek-ai/DeepSeek-V2-Lite's config.json (the fields the engine reads)
V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1,
    moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
    scoring_func="softmax", max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, hidden_act="silu",
    tie_word_embeddings=False, rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                                 mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1))


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_expanded_prefill_gives_the_absorbed_layer_output(name):
    """One attention layer of the tiny V2 / V3 (their configs, random weights) over a ragged step: a
    20-token prompt chunk after 40 cached tokens (3 chunks of 16 positions), a decode token after 23,
    padding: the expanded path's output equals the absorbed path's within 1e-5 (float32), the pool too."""
    import transformers

    from jaxserve.models import mla
    from jaxserve.models.deepseek import param_shapes
    from tests.deepseek_fixtures import CHECKPOINTS, COMMON

    cls_name, extra = CHECKPOINTS[name]
    hf = getattr(transformers, cls_name)(**COMMON, **extra).to_dict()
    cfg = ModelConfig.from_hf({**hf, "architectures": [cls_name.replace("Config", "ForCausalLM")]})
    shapes = sorted((k, v[1:]) for k, v in param_shapes(cfg)["layers"].items() if k in MLA_LEAVES)
    keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
    lp = {k: (1.0 if "norm" in k else 0.0) + 0.2 * jax.random.normal(key, shape, jnp.float32)
          for key, (k, shape) in zip(keys, shapes)}
    rng = np.random.default_rng(0)
    kv_lens, blocks = [60, 24], 8  # 20 new tokens of sequence 0, 1 of sequence 1
    table = rng.permutation(2 * blocks).astype(np.int32).reshape(2, blocks)
    positions = np.concatenate([np.arange(40, 60), [23], [0, 0, 0]]).astype(np.int32)  # 3 padding tokens
    seq = np.concatenate([[0] * 20, [1], [0, 0, 0]])
    slots = np.where(np.arange(24) < 21, table[seq, positions // 16] * 16 + positions % 16, -1).astype(np.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                           block_tables=jnp.asarray(table), cu_q_lens=jnp.asarray([0, 20, 21], jnp.int32),
                           num_seqs=jnp.asarray([2], jnp.int32))
    pool = jnp.asarray(rng.standard_normal((1, 1, 2 * blocks, 16, 40), np.float32))
    x = jnp.asarray(rng.standard_normal((24, cfg.hidden_size), np.float32))
    inv_freq = jnp.asarray(mla.rope_frequencies(cfg), jnp.float32)
    out = {}
    for form in ("absorbed", "expanded"):
        mla_prefill.FORCE, mla_prefill.CHUNK_TOKENS = form, 16
        try:
            out[form] = jax.jit(lambda lp, x, pool, md: mla.attention(  # traced here, under `form`
                cfg, lp, x, jnp.asarray(positions), pool, md, jnp.int32(0), inv_freq))(lp, x, pool, md)
        finally:
            mla_prefill.FORCE, mla_prefill.CHUNK_TOKENS = None, 256
    (y_abs, pool_abs), (y_exp, pool_exp) = out["absorbed"], out["expanded"]
    assert len(lp) == (6 if name == "v2" else 8) and float(jnp.max(jnp.abs(y_abs[:21]))) > 0.1  # not vacuous
    np.testing.assert_allclose(np.asarray(y_exp[:21]), np.asarray(y_abs[:21]), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(pool_exp), np.asarray(pool_abs))


def test_expanded_prefill_equals_transformers(tmp_path, monkeypatch, name: str = "v2"):
    """The tiny V2 (V2-Lite's layout) served with the expanded path forced on for every multi-token step,
    16-position chunks, 16-token steps: LONG's
    last chunk (8 new over 32 cached) and CACHED's 6 new over a 32-token prefix-cache hit read 3 chunks
    each; greedy tokens equal transformers' float32 tokens, logprobs within 1e-4. jax's caches are
    cleared around the engine: a program traced under another form is not reused, nor this one after."""
    path = save_checkpoint(name, tmp_path)
    reference, ref_logprobs = hf_reference(path, [LONG, CACHED], max_tokens=3)
    monkeypatch.setattr(mla_prefill, "FORCE", "expanded")
    monkeypatch.setattr(mla_prefill, "CHUNK_TOKENS", 16)
    jax.clear_caches()
    engine = make_engine(path, enforce_eager=True, enable_prefix_caching=True)
    try:
        tokens, logprobs = engine_run(engine, [LONG], max_tokens=3)
        hits = engine.get_stats().prefix_cache_hits
        more, more_logprobs = engine_run(engine, [CACHED], max_tokens=3)
        assert engine.get_stats().prefix_cache_hits >= hits + 32
    finally:
        engine.shutdown()
        jax.clear_caches()
    assert tokens + more == reference
    assert_logprobs_close(logprobs + more_logprobs, ref_logprobs, what=name)


def metadata(q_lens: list[int], kv_lens: list[int]) -> AttentionMetadata:
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return AttentionMetadata(slot_mapping=jnp.zeros(int(cu[-1]), jnp.int32), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                             block_tables=jnp.zeros((len(q_lens), 512), jnp.int32), cu_q_lens=jnp.asarray(cu),
                             num_seqs=jnp.asarray([len(q_lens)], jnp.int32))


def test_rule_picks_expanded_for_long_prefills_only():
    """V2-Lite's shape, the CPU-measured weight (0.1): a step under 18 tokens never expands
    (0.1 x 512 x 256 / (1088 - 320)); 64 new tokens do, cached prefix or not; 64 decode tokens at 8k
    beside a prompt send the step back to absorbed (the expanded path scores all T tokens per key)."""
    cfg = ModelConfig.from_hf(V2_LITE)
    assert mla_prefill.min_expanded_tokens(cfg) == 18
    prefers = lambda q, kv: bool(mla_prefill.prefers_expanded(cfg, metadata(q, kv), sum(q), 16))  # noqa: E731
    assert prefers([64], [64]) and prefers([256], [2304]) and prefers([2048], [6144])
    assert not prefers([16], [16])
    assert not prefers([1024] + [1] * 64, [1024] + [8192] * 64)


def test_latent_pool_holds_about_9x_the_expanded_layouts_tokens():
    """The issue's "Must show": in the same memory, DeepSeek-V2-Lite's latent pool (kv_lora_rank + rope =
    576 per token and layer) holds 8.9x the tokens of the expanded layout (16 heads x (nope + rope + v) =
    5,120: K 192 and V 128 wide per head), through the engine's own block sizing; V3 (128 heads) 71x."""
    from jaxserve.worker.kv_sizing import kv_bytes_per_block

    cfg = ModelConfig.from_hf(V2_LITE)
    m = cfg.mla
    latent = kv_bytes_per_block(cfg, 16, jnp.bfloat16)
    assert latent == 16 * (m.kv_lora_rank + m.qk_rope_head_dim) * cfg.num_layers * 2
    per_head = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim  # K and V of one head, per token
    # the expanded layout as the engine sizes a plain attention pool: 16 KV heads, K and V 160 wide each
    plain = replace(cfg, architecture="LlamaForCausalLM", mla=None, moe=None, head_dim=per_head // 2)
    expanded = kv_bytes_per_block(plain, 16, jnp.bfloat16)
    assert expanded == 16 * cfg.num_heads * per_head * cfg.num_layers * 2
    memory = 40 << 30  # what an H100 has left for the pool beside V2-Lite's 31 GiB of weights
    latent_tokens, expanded_tokens = 16 * (memory // latent), 16 * (memory // expanded)
    assert latent_tokens / expanded_tokens == pytest.approx(5120 / 576, rel=1e-3)  # 8.9x
    assert 8.5 < latent_tokens / expanded_tokens < 9.5
    v3_heads = 128
    assert v3_heads * per_head / (m.kv_lora_rank + m.qk_rope_head_dim) == pytest.approx(71.1, abs=0.1)
