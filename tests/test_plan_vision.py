"""`jaxserve plan` on a vision-language model (issue 52): the tower's weights (transformers' own parameter
count), its largest program's activations (XLA's measurement of the engine's compiled tower) and the
encoder cache, sized with the engine's own runner; Qwen2.5-VL-3B's published shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.vision.config import vision_from_hf
from jaxserve.plan import add_arguments, plan, render
from jaxserve.plan.vision import tower_activation_bytes, vision_params
from tests.vl_fixtures import TEXT, TOKEN_IDS, VISION_2, VISION_25, save_vl_checkpoint

KINDS = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel",
                        VISION_25),
         "qwen2_vl": ("Qwen2VLConfig", "qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel", VISION_2)}
# Qwen/Qwen2.5-VL-3B-Instruct's config.json and preprocessor_config.json (the values that size it)
QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 2048,
    "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu", "use_sliding_window": False,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "temporal_patch_size": 2}}
QWEN25_VL_PROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                       "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}


def run_plan(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return plan(parser.parse_args(list(argv)))


@pytest.mark.parametrize("kind", KINDS)
def test_tower_params_equal_transformers_numel(kind):
    import importlib

    import transformers

    config_cls, tower_cls, vision = KINDS[kind]
    # widths that are not multiples of one another (a wrong term would not cancel out)
    vision = {**vision, "depth": 2, "num_heads": 3, **({"hidden_size": 36, "intermediate_size": 50}
                                                       if kind == "qwen2_5_vl" else {"embed_dim": 36, "mlp_ratio": 3})}
    cfg = getattr(transformers, config_cls)(text_config=TEXT, vision_config=vision, **TOKEN_IDS)
    module, name = tower_cls.rsplit(".", 1)  # the model's `visual`: transformers' tower class alone
    tower = getattr(importlib.import_module(f"transformers.models.{module}"), name)._from_config(cfg.vision_config)
    numel = sum(p.numel() for p in tower.parameters())
    assert numel > 0 and vision_params(vision_from_hf(cfg.to_dict(), kind)) == numel


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_vl_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("vl") / "qwen2_5_vl")


def test_budget_and_cache_are_the_engines(checkpoint):
    """The encoder budget, the largest program and the cache: the runner's own, after the processor's bind."""
    from jaxserve.multimodal.processor import ImageProcessor
    from jaxserve.multimodal.runner import MultiModalRunner
    from jaxserve.plan.source import read_model

    vc = read_model(str(checkpoint)).config.vision
    for tokens in (16, 512):  # the processor's largest image (256 patches) raises 64; 2048 stands
        runner = MultiModalRunner(vc, jnp.float32, tokens)
        ImageProcessor(vc, checkpoint).bind(runner)
        r = run_plan(str(checkpoint), "--gpu", "H100", "--max-model-len", "128", "--dtype", "float32",
                     "--max-num-batched-tokens", str(tokens))
        assert (r["vision_patch_budget"], r["vision_largest_program_patches"]) == (runner.patch_budget,
                                                                                   runner.buckets[-1])
        assert r["encoder_cache_bytes"] == runner.cache_bytes
    assert r["vision_max_image_patches"] == 256 and r["vision_weights_bytes"] == 4 * vision_params(vc)
    # the KV budget is what is left after the tower too
    assert r["kv_budget_bytes"] == (r["memory_allowed_bytes"] - r["weights_bytes_per_device"] - r["lora_bytes"]
                                    - r["vision_weights_bytes"] - max(r["activation_bytes"],
                                                                      r["vision_activation_bytes"]))


def test_tower_activation_estimate_is_near_xlas_measurement(checkpoint):
    """The engine's compiled tower at its largest bucket, and at 65536 patches (Qwen2.5-VL's own
    max_pixels): XLA's temporaries against the estimate, and linear in the patches, far below the
    [heads, N, N] float32 scores a dense attention would hold."""
    from jaxserve.models.vision.qwen2_vl_vision import patch_layout, vision_forward
    from jaxserve.multimodal.runner import MultiModalRunner
    from jaxserve.plan.source import read_model

    vc = read_model(str(checkpoint)).config.vision
    runner = MultiModalRunner(vc, jnp.float32, 256)  # 1024 patches
    shapes = jax.eval_shape(lambda: _random_params(vc))
    measured = {}
    for size in (runner.buckets[-1], 65536):
        layout = patch_layout(vc, [(1, 2, size // 2)], size)
        compiled = jax.jit(vision_forward, static_argnums=1).lower(
            shapes, vc, jax.ShapeDtypeStruct((size, vc.patch_dim), jnp.float32), *layout).compile()
        measured[size] = compiled.memory_analysis().temp_size_in_bytes
        estimate = tower_activation_bytes(vc, size, 4)
        assert 0.8 * measured[size] < estimate < 1.25 * measured[size], (size, measured[size], estimate)
    assert measured[65536] < 80 * measured[1024]  # 64x the patches
    assert measured[65536] < 65536 ** 2 * vc.num_heads * 4 / 32, measured


def _random_params(vc) -> dict:
    from jaxserve.models.vision.qwen2_vl_vision import read_vision_params

    rng = np.random.default_rng(0)
    return read_vision_params(vc, lambda name: rng.standard_normal(_HF_SHAPES(vc, name)), jnp.float32, "visual.")


def _HF_SHAPES(vc, name: str) -> tuple[int, ...]:  # noqa: N802  the checkpoint's tensor shapes, by name
    d, i, m = vc.hidden_size, vc.intermediate_size, vc.merge_unit * vc.hidden_size
    leaf = name.split(".", 3)[-1] if ".blocks." in f".{name}" else name.removeprefix("visual.")
    table = {"norm1.weight": (d,), "norm2.weight": (d,), "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
             "attn.proj.weight": (d, d), "attn.proj.bias": (d,), "mlp.gate_proj.weight": (i, d),
             "mlp.up_proj.weight": (i, d), "mlp.down_proj.weight": (d, i), "mlp.gate_proj.bias": (i,),
             "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (d,), "merger.ln_q.weight": (d,),
             "merger.mlp.0.weight": (m, m), "merger.mlp.0.bias": (m,), "merger.mlp.2.weight": (vc.out_hidden_size, m),
             "merger.mlp.2.bias": (vc.out_hidden_size,), "patch_embed.proj.weight": (d, vc.patch_dim),
             # Qwen2-VL's LayerNorm biases and fc1 / fc2 MLP
             "norm1.bias": (d,), "norm2.bias": (d,), "merger.ln_q.bias": (d,), "mlp.fc1.weight": (i, d),
             "mlp.fc1.bias": (i,), "mlp.fc2.weight": (d, i), "mlp.fc2.bias": (d,)}
    return table[leaf]


def test_qwen25_vl_3b_shape(tmp_path):
    """Qwen2.5-VL-3B: a 668.7 M-parameter tower (3.75 B in all, the model card's); with its processor's
    max_pixels (12845056: 65536 patches) the tower's largest program needs about 6.3 GB (a dense
    attention's would be ~415 GB), so the model fits an H100 with its own defaults."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_VL_3B))
    r = run_plan(str(tmp_path), "--gpu", "H100", "--max-model-len", "8192")
    assert r["vision_params"] == 668_684_288 and r["vision_weights_bytes"] == 2 * 668_684_288
    assert 3.75e9 < r["total_params"] < 3.76e9 and r["fits"]
    assert r["vision_largest_program_patches"] == 2048 and r["encoder_cache_image_tokens"] == (512 << 20) // 4096
    text = render(r)
    assert "vision tower        1.34 GB  (668.7 M params" in text and "encoder cache       0.54 GB" in text
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN25_VL_PROCESSOR))
    r = run_plan(str(tmp_path), "--gpu", "H100", "--max-model-len", "8192")
    assert r["vision_largest_program_patches"] == 65536 and r["fits"]
    assert 6e9 < r["vision_activation_bytes"] < 7e9 and "vision activation   6.31 GB" in render(r)
    # a processor that makes absurd images: the tower's program alone is past the device
    r = run_plan(str(tmp_path), "--gpu", "H100", "--max-model-len", "8192", "--mm-processor-kwargs",
                 '{"max_pixels": 2000000000}')
    assert not r["fits"] and "the vision tower's largest program alone exceeds the allowed memory" in render(r)
    # serve's --mm-processor-kwargs over the file's max_pixels: 5120 patches, an 8192-patch program that fits
    r = run_plan(str(tmp_path), "--gpu", "H100", "--max-model-len", "8192", "--mm-processor-kwargs",
                 '{"max_pixels": 1003520}', "--mm-processor-cache-gb", "1")
    assert (r["vision_patch_budget"], r["vision_largest_program_patches"], r["fits"]) == (5120, 8192, True)
    assert r["processor_cache_bytes"] == 1 << 30
    with pytest.raises(ValueError, match="mm_processor_kwargs: does not apply to LlamaForCausalLM"):
        run_plan("meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--mm-processor-kwargs", "{}")
