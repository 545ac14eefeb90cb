"""`jaxserve plan` and the sizing arithmetic it shares with the engine (jaxserve/worker/sizing.py)."""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
import pytest

from jaxserve import cli
from jaxserve.engine.args import EngineArgs
from jaxserve.models.config import ModelConfig
from jaxserve.plan import add_arguments, plan
from jaxserve.plan.source import bundled_ids, read_model
from jaxserve.worker import sizing

GB = 1e9


def run_plan(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return plan(parser.parse_args(list(argv)))


# ---- the article's FAQ --------------------------------------------------------------------------
def test_70b_fp16_does_not_fit_one_a100_80gb_and_plan_says_what_does():
    r = run_plan("meta-llama/Llama-3.1-70B-Instruct", "--gpu", "A100-80GB", "--dtype", "float16",
                 "--max-model-len", "4096")
    assert not r["fits"]
    assert 139 * GB < r["weights_bytes_per_device"] < 143 * GB  # "about 140 GB"
    assert r["suggest_parallel"]["num_devices"] == 2 and "--tensor-parallel-size 2" in r["suggest_parallel"]["flags"]
    assert "--quantization" in r["suggest_quantization"]["flags"]


def test_70b_awq_fits_one_a100_80gb_with_about_thirty_4k_sequences():
    r = run_plan("TheBloke/Llama-2-70B-Chat-AWQ", "--gpu", "A100-80GB", "--max-model-len", "4096")
    assert r["fits"] and r["quantization"] == "awq"
    assert 35 * GB < r["weights_bytes_per_device"] < 40 * GB  # the article: 35-40 GB
    # 80 layers x 8 kv heads x 128 x (K, V) x 2 bytes
    assert r["kv_bytes_per_token"] == 80 * 8 * 128 * 2 * 2
    assert r["max_concurrent_seqs"] == r["num_gpu_blocks"] // (4096 // 16)
    assert 20 <= r["max_concurrent_seqs"] <= 40
    same = run_plan("meta-llama/Llama-3.1-70B-Instruct", "--gpu", "A100-80GB", "--quantization", "awq",
                    "--max-model-len", "4096")
    assert same["fits"] and 35 * GB < same["weights_bytes_per_device"] < 40 * GB


def test_70b_fp8_tp2_fits_two_a100_80gb():
    r = run_plan("meta-llama/Llama-3.1-70B-Instruct", "--gpu", "A100-80GB", "--tensor-parallel-size", "2",
                 "--quantization", "fp8", "--max-model-len", "4096")
    assert r["fits"] and r["num_devices"] == 2
    assert 34 * GB < r["weights_bytes_per_device"] < 38 * GB
    assert r["kv_bytes_per_token"] == 80 * 4 * 128 * 2 * 2  # 4 of the 8 kv heads per device
    assert r["decode_tokens_per_s_batch1"] > 0


def test_pipeline_parallel_halves_the_largest_stage():
    one = run_plan("meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4", "--max-model-len", "8192")
    two = run_plan("meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4", "--max-model-len", "8192", "-pp", "2")
    assert two["stages"] == [[0, 16], [16, 32]] or two["stages"] == [(0, 16), (16, 32)]
    assert two["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"]
    assert two["weights_bytes_per_device"] < 0.55 * one["weights_bytes_per_device"]


def test_gpu_memory_utilization_above_095_is_refused():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=0.98)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        run_plan("meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--gpu-memory-utilization", "0.99")


def test_engine_refuses_weights_over_the_allowed_share_with_the_numbers():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: weights \(70 bytes\).*= 72 bytes"):
        sizing.kv_budget(100, 0.5, 70, 2)
    assert sizing.kv_budget(100, 0.9, 70, 2) == 18


def test_cli_json_exits_zero_either_way(capsys):
    assert cli.main(["plan", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "A100-80GB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["fits"] is False
    for key in ("weights_bytes_per_device", "kv_bytes_per_token", "num_gpu_blocks", "max_concurrent_seqs"):
        assert isinstance(r[key], int)
    assert cli.main(["plan", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "H200"]) == 0
    assert "verdict: FITS" in capsys.readouterr().out
    assert cli.main(["plan", "no/such-model", "--gpu", "H200"]) == 2
    assert "plan never downloads" in capsys.readouterr().out


def test_bundled_configs_are_the_real_models():
    assert len(bundled_ids()) == 8
    cfg = read_model("Qwen/Qwen2.5-72B-Instruct").config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.intermediate_size) == (80, 8192, 8, 29568)
    assert read_model("TheBloke/Llama-2-70B-Chat-AWQ").quantization == "awq"


def test_hf_directory_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["MistralForCausalLM"], vocab_size=1000, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)))
    r = run_plan(str(tmp_path), "--gpu", "L4", "--max-model-len", "512", "-pp", "3")
    assert r["fits"] and r["stages"] == [(0, 1), (1, 2), (2, 3)] and r["kv_bytes_per_token"] == 2 * 2 * 16 * 2


def test_uneven_stages_put_the_extra_layers_in_the_middle():
    assert sizing.stage_layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert sizing.stage_layer_ranges(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        sizing.stage_layer_ranges(2, 3)


# ---- the engine's own numbers ---------------------------------------------------------------------
@pytest.mark.parametrize("quant", [None, "int8"])
def test_weight_bytes_equal_the_loaded_arrays(quant):
    from tests.parallel_worker import BASE, FAMILIES, random_params
    from jaxserve.quantization.quantize import quantize_params

    for extra in FAMILIES.values():
        cfg = ModelConfig(**{**BASE, **extra})
        params = jax.tree.map(jax.numpy.asarray, random_params(cfg))
        if quant:
            params = quantize_params(params, cfg, quant, np.arange(16) % cfg.vocab_size)
        assert sum(x.nbytes for x in jax.tree.leaves(params)) == sizing.weight_bytes_per_device(cfg, 4, 1, 1, quant)


@pytest.mark.parametrize("flags", [
    dict(),
    dict(block_size=32, kv_cache_dtype="bfloat16", max_model_len=1024, kv_cache_memory=64 << 20),
    dict(block_size=8, kv_cache_dtype="float32", max_model_len=512, kv_cache_memory=40 << 20),
])
def test_plan_equals_the_engine_at_start_up_on_this_cpu(jax_default_model, monkeypatch, flags):
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.worker.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "warmup", lambda self, progress=True: 0)  # sizing only
    engine = LLMEngine(EngineArgs(**flags, compilation_cache_dir=""), model=jax_default_model, progress=False)
    argv = ["--gpu", "cpu", "--dtype", "float32"]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    r = run_plan(*argv)
    k, v = engine.runner.kv
    assert r["num_gpu_blocks"] == engine.num_gpu_blocks == k.shape[2]
    assert r["kv_bytes_per_block"] * r["num_gpu_blocks"] == k.nbytes + v.nbytes
    assert r["weights_bytes_per_device"] == sum(x.nbytes for x in jax.tree.leaves(engine.model.params))
    assert r["max_model_len"] == engine.max_model_len


def test_activation_estimate_is_near_xlas_measurement(jax_default_model):
    from jaxserve.worker.model_runner import RunnerConfig, activation_bytes

    rc = RunnerConfig(num_blocks=200, block_size=16, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048)
    measured = activation_bytes(jax_default_model, rc)
    estimate = sizing.activation_bytes_estimate(jax_default_model.config, 512, 64, 4)
    assert 0.5 * measured < estimate < 2 * measured, (measured, estimate)


def test_engine_refuses_before_loading_when_the_weights_cannot_fit(monkeypatch):
    from jaxserve.worker import kv_sizing

    monkeypatch.setattr(kv_sizing.jax, "default_backend", lambda: "gpu")
    cfg = read_model("meta-llama/Llama-3.1-70B-Instruct").config
    monkeypatch.setattr(kv_sizing, "device_memory_bytes", lambda: 81920 << 20)  # an A100-80GB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: weights \(141\d{9} bytes\)"):
        kv_sizing.refuse_oversized_weights(cfg, 2, **_fit_flags(EngineArgs(max_model_len=4096)))
    kv_sizing.refuse_oversized_weights(cfg, 2, **_fit_flags(EngineArgs(max_model_len=4096, tensor_parallel_size=2)))


def _fit_flags(args: EngineArgs) -> dict:
    names = ("tensor_parallel_size", "pipeline_parallel_size", "quantization", "max_model_len",
             "max_num_batched_tokens", "enable_chunked_prefill", "max_num_seqs", "gpu_memory_utilization")
    return {name: getattr(args, name) for name in names}


def test_pipeline_parallel_is_accepted_with_data_parallel_and_several_hosts():
    assert EngineArgs(pipeline_parallel_size=2, data_parallel_size=2).data_parallel_size == 2
    assert EngineArgs(pipeline_parallel_size=2, num_hosts=2, host_rank=0).num_hosts == 2
