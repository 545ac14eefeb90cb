"""weights/source.py: one description of a model (format, config, quantization, dtype, tokenizer
source) for every kind of --model, reading no weights; the loader and `jaxserve plan` use it."""

from __future__ import annotations

import json

import pytest

from jaxserve.models.config import ModelConfig
from jaxserve.plan.source import read_model
from jaxserve.weights.loader import load_model
from jaxserve.weights.source import CHECKPOINT_MARKER, bundled_ids, default_model_path, describe_model
from tests.test_weights import HF_CONFIG, write_tiny_dir


def test_the_default_model_is_its_gguf():
    src = describe_model(None)
    assert src.format == "gguf" and src.path == default_model_path() == src.tokenizer
    assert src.name == "SmolLM2-135M-Instruct" and src.quantization is None
    assert src.config.architecture == "LlamaForCausalLM" and src.config.num_layers == 30
    assert read_model(None).config == src.config  # plan reads the same


def test_an_hf_directory(tmp_path):
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    write_tiny_dir(tmp_path, {**HF_CONFIG, "torch_dtype": "bfloat16", "quantization_config": awq})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    src = describe_model(str(tmp_path))
    assert (src.format, src.path, src.name, src.torch_dtype) == ("hf", tmp_path, str(tmp_path), "bfloat16")
    assert src.quantization == "awq" and src.quant_spec(None).method == "awq"
    with pytest.raises(ValueError, match="quantization: 'gptq' was asked for but the checkpoint is quantized"):
        src.quant_spec("gptq")
    assert src.tokenizer is None  # no tokenizer files: prompts must be token ids
    assert 7 in src.config.eos_token_ids  # generation_config.json's ids join config.json's
    (tmp_path / "tokenizer.json").write_text("{}")
    assert describe_model(str(tmp_path)).tokenizer == tmp_path


def test_a_converted_checkpoint_is_described_by_its_marker(tmp_path):
    cfg = ModelConfig.from_hf(HF_CONFIG)
    (tmp_path / CHECKPOINT_MARKER).write_text(json.dumps({"format_version": 1, "config": cfg.to_dict()}))
    src = describe_model(str(tmp_path))
    assert src.format == "checkpoint" and src.config == cfg and src.quantization is None
    assert read_model(str(tmp_path)).config == cfg  # plan sizes a converted checkpoint too
    (tmp_path / CHECKPOINT_MARKER).write_text(json.dumps({"format_version": 99, "config": cfg.to_dict()}))
    with pytest.raises(ValueError, match="unsupported format_version 99"):
        describe_model(str(tmp_path))
    moe = ModelConfig.from_hf({**HF_CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    for version in (1, 2):  # a MoE model converted before its experts became [E, out, in] is refused
        (tmp_path / CHECKPOINT_MARKER).write_text(json.dumps({"format_version": version, "config": moe.to_dict()}))
        if version == 1:
            with pytest.raises(ValueError, match="convert the model again"):
                describe_model(str(tmp_path))
        else:
            assert describe_model(str(tmp_path)).config == moe


def test_bundled_configs_answer_plan_but_never_the_loader(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    hub_id = "meta-llama/Llama-3.1-8B-Instruct"
    assert hub_id in bundled_ids()
    src = read_model(hub_id)
    assert src.format == "config" and src.path is None and src.where == f"bundled config {hub_id}"
    assert src.config.num_layers == 32 and src.torch_dtype == "bfloat16"
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache.*never downloads"):
        describe_model(hub_id)
    with pytest.raises(ValueError, match="holds no weights to load"):
        load_model(src, progress=False)
    with pytest.raises(FileNotFoundError, match="not bundled .*plan never downloads"):
        read_model("nobody/NoSuchModel")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    for describe in (describe_model, read_model):  # the engine's reading and plan's
        with pytest.raises(ValueError, match=r"must be a \.gguf"):
            describe(str(tmp_path / "model.safetensors"))
