"""DeepSeek V2 / V3 (multi-head latent attention, DeepSeek's routers) against transformers: tiny random
checkpoints saved by transformers' own classes (tests/deepseek_fixtures.py), greedy tokens equal to
transformers' float32 tokens and each token's logprob within 1e-4 under the exact float32 flags, with
chunked prefill (4-token steps) and a prefix-cache hit; the routers' expert choice against
transformers' router modules; the latent pool's size; bad configs and unsupported flags refused."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.deepseek_fixtures import CHECKPOINTS, COMMON, save_checkpoint
from tests.logprob_parity import assert_logprobs_close
from tests.moe_fixtures import PROMPTS, engine_run, hf_reference, make_engine

# a prompt sharing its first 16 tokens (one full block) with PROMPTS[0], sent after it: a prefix-cache hit
CACHED = PROMPTS[0][:16] + [3, 1, 4]


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def served(request, tmp_path_factory):
    """(name, checkpoint, its engine): one eager engine per checkpoint, 4-token steps (chunked prefill)."""
    path = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    engine = make_engine(path, enforce_eager=True, max_num_batched_tokens=4, enable_prefix_caching=True)
    yield request.param, path, engine
    engine.shutdown()


def test_greedy_tokens_and_logprobs_equal_transformers(served):
    name, path, engine = served
    cfg = engine.model.config
    m, e = cfg.mla, cfg.moe  # what the checkpoint exists for survived config.json
    assert (m.kv_lora_rank, m.qk_rope_head_dim, m.q_lora_rank) == (32, 8, 0 if name == "v2" else 24)
    assert m.rope_interleave == name.startswith("v2")
    router = {"v2": "group_limited_greedy", "v2_q_lora": "greedy", "v3": "noaux_tc"}[name]
    assert e.router == router and (router == "greedy" or (e.n_group, e.topk_group) == (4, 2))
    assert e.dense_layers == (() if name == "v2" else (0,)) and e.shared_expert_intermediate_size == 32
    reference, ref_logprobs = hf_reference(path, PROMPTS + [CACHED])
    tokens, logprobs = engine_run(engine, PROMPTS)
    hits = engine.get_stats().prefix_cache_hits
    more, more_logprobs = engine_run(engine, [CACHED])
    assert engine.get_stats().prefix_cache_hits >= hits + 16
    assert tokens + more == reference
    assert_logprobs_close(logprobs + more_logprobs, ref_logprobs, what=name)


def test_latent_pool_holds_one_entry_per_token_and_layer(served):
    """(kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes per token, in the engine's pool, its sizing
    and `jaxserve plan`; the expanded per-head K and V would take 2 x heads x (nope + rope) per layer."""
    from jaxserve.plan.estimate import Setting, estimate
    from jaxserve.worker.kv_sizing import kv_bytes_per_block

    _, _, engine = served
    cfg = engine.model.config
    per_token = (32 + 8) * cfg.num_layers * 4  # float32
    latent, empty = engine.runner.kv
    assert latent.shape == (cfg.num_layers, 1, engine.num_gpu_blocks, 16, 40) and empty.size == 0
    assert latent.nbytes == engine.num_gpu_blocks * 16 * per_token
    assert kv_bytes_per_block(cfg, 16, np.float32) == 16 * per_token
    assert engine.num_gpu_blocks == (1 << 20) // (16 * per_token)  # kv_cache_memory 1 MiB
    assert estimate(Setting(cfg, None, kv_dtype_bytes=2, kv_cache_memory=1 << 20))["kv_bytes_per_token"] == \
        per_token // 2
    expanded = 2 * cfg.num_heads * (16 + 8) * cfg.num_layers * 4
    assert expanded / per_token == pytest.approx(4.8)  # these tiny shapes; V3: 128 x (192 + 128) vs 576, 71x


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_mixed_layers_hold_only_their_own_weights(name, tmp_path):
    """A model mixing dense and MoE layers (V3: first_k_dense_replace 1 of 3; Qwen3-MoE: mlp_only_layers
    [1] of 3) holds transformers' parameters and no more: no zero MLP in the sparse layers, no zero
    experts in the dense one (the `sparse` flag [L] is the engine's one addition); `jaxserve plan`'s
    weight bytes and parameter count say the same."""
    import jax
    import torch
    import transformers

    from jaxserve.plan.estimate import total_params
    from jaxserve.weights.loader import load_model
    from jaxserve.worker.sizing import stage_weight_bytes
    from tests.moe_fixtures import save_checkpoint as save_moe

    path = save_checkpoint("v3", tmp_path) if name == "deepseek_v3" else save_moe(name, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = sum(p.numel() for p in hf.parameters()) + sum(  # V3's selection bias is a buffer in the checkpoint
        b.numel() for k, b in hf.named_buffers() if k.endswith("e_score_correction_bias"))
    loaded = load_model(str(path), "float32", progress=False)
    cfg, layers = loaded.config, loaded.params["layers"]
    assert cfg.moe.dense_layers == ((0,) if name == "deepseek_v3" else (1,))
    assert layers["w_gate"].shape[0] == 1 and layers["we_gate"].shape[0] == layers["router"].shape[0] == 2
    held = sum(x.size for x in jax.tree.leaves(loaded.params))
    assert held == want + cfg.num_layers  # the flag
    assert sum(x.nbytes for x in jax.tree.leaves(loaded.params)) == 4 * held
    assert stage_weight_bytes(cfg, 4) == 4 * held
    assert total_params(cfg) == want


@pytest.mark.parametrize("name", ["v2", "v2_q_lora", "v3"])
def test_router_selects_the_experts_transformers_selects(name):
    """1,000 tokens through transformers' router module and DeepSeek's router here: the same experts,
    weights within float32 rounding (V3: a random selection bias, V2: group_limited_greedy and greedy)."""
    import importlib

    import jax.numpy as jnp
    import torch
    import transformers

    from jaxserve.models.config import ModelConfig
    from jaxserve.models.deepseek_router import GroupedTopK

    cls_name, extra = CHECKPOINTS[name]
    hf_cfg = getattr(transformers, cls_name)(**COMMON, **extra)
    kind = name[:2]  # v2 / v3: transformers' module
    modeling = importlib.import_module(f"transformers.models.deepseek_{kind}.modeling_deepseek_{kind}")
    module = getattr(modeling, f"Deepseek{kind.upper()}TopkRouter")
    torch.manual_seed(1)
    router = module(hf_cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        if name == "v3":
            router.e_score_correction_bias.copy_(torch.rand(8) * 0.3)
    x = torch.randn(1000, 64)
    with torch.no_grad():
        _, want_w, want_ids = router(x)
    e = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": [f"Deepseek{kind.upper()}ForCausalLM"]}).moe
    select = GroupedTopK(e.router, e.num_experts_per_tok, e.n_group, e.topk_group, e.norm_topk_prob,
                         e.routed_scaling_factor)
    logits = jnp.asarray(x.numpy()) @ jnp.asarray(router.weight.detach().numpy().T)
    bias = jnp.asarray(router.e_score_correction_bias.numpy()) if name == "v3" else None
    ids, weights = (np.asarray(a) for a in select(logits, bias))
    order_got, order_want = np.argsort(ids, axis=1), np.argsort(want_ids.numpy(), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids, order_got, 1),
                                  np.take_along_axis(want_ids.numpy(), order_want, 1))
    np.testing.assert_allclose(np.take_along_axis(weights, order_got, 1),
                               np.take_along_axis(want_w.numpy(), order_want, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field, value", [
    ("kv_lora_rank", 0), ("qk_rope_head_dim", 7), ("topk_method", "sparse"), ("n_group", 3),
    ("hidden_act", "gelu"), ("num_experts_per_tok", 9), ("attention_bias", True)])
def test_bad_config_is_a_value_error_naming_the_field(field, value):
    from jaxserve.models.config import ModelConfig

    hf = {**COMMON, **CHECKPOINTS["v2"][1], "architectures": ["DeepseekV2ForCausalLM"], "rope_parameters": None,
          "n_group": 4, "topk_group": 2, field: value}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(hf)


def test_unsupported_flags_are_refused_at_start_up(tmp_path):
    """Before any weight is read (the directory has none): the flag is named."""
    import json

    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.models import registry
    from jaxserve.models.config import ModelConfig

    hf = {**COMMON, **CHECKPOINTS["v3"][1], "architectures": ["DeepseekV3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for flag, value in (("quantization", "int8"),):  # --attention-backend pallas serves (test_deepseek_pallas.py)
        with pytest.raises(ValueError, match=f"^{flag}: not supported for DeepseekV3ForCausalLM"):
            LLMEngine(EngineArgs(model=str(tmp_path), **{flag: value}), progress=False)
    cfg = ModelConfig.from_hf(hf)
    registry.refuse_flags(cfg, EngineArgs(model=str(tmp_path), pipeline_parallel_size=2))  # served (TP test below)
    with pytest.raises(ValueError, match="^quantization_config: not supported"):
        registry.refuse_flags(cfg, EngineArgs(model=str(tmp_path)), "gptq")  # fp8: test_deepseek_fp8.py


@pytest.mark.multidevice
def test_tensor_and_pipeline_parallel_greedy_equals_transformers(tmp_path):
    """TP 2 (2 fake CPU devices, tests/moe_worker.py): the heads of q, W_UK, W_UV and wo split, the
    latent pool replicated (its sizing and `jaxserve plan` say so), the experts split by expert
    (--enable-expert-parallel); PP 2 (the same worker): layer 0 (dense) and its latent pool on one
    device, layers 1-2 (MoE) on the other, run by deepseek.run_layers per stage: transformers' tokens
    and logprobs, as on one device."""
    import json

    from jaxserve.models.config import ModelConfig
    from jaxserve.parallel.specs import partition_plan
    from jaxserve.plan.estimate import Setting, estimate
    from tests.worker_run import run_json_worker

    path = save_checkpoint("v3", tmp_path / "v3")
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    plan = partition_plan(cfg, 2)
    assert plan.kv_cache == P() and plan.notes["kv_cache"].startswith("replicated: the latent pool")
    assert plan.specs["layers"]["w_uk"] == P(None, "model", None, None)
    one, two = (estimate(Setting(cfg, None, tensor_parallel_size=tp, kv_cache_memory=1 << 20)) for tp in (1, 2))
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] == (32 + 8) * 3 * 2  # not divided by TP
    assert two["kv_pool"] == "latent, 40 values per token per layer, replicated on each of the 2 TP devices"
    reference, ref_logprobs = hf_reference(path, PROMPTS[:2])
    options = json.dumps({"settings": {"v3": [[2, 1, True], [1, 2, False]]}, "prompts": PROMPTS[:2],
                          "engine": {"enforce_eager": True}})
    results = run_json_worker("moe_worker", "--options", options, str(path), devices=2)
    for setting in ("v3/tp2/pp1/ep", "v3/tp1/pp2"):
        assert results[setting]["tokens"] == reference, setting
        assert_logprobs_close(results[setting]["logprobs"], ref_logprobs, what=setting)
