"""DeepSeek-V3 block-wise FP8 checkpoints as the hub ships them (tests/deepseek_fixtures.save_fp8_v3: a
tiny V3 saved by transformers, its q_a / q_b / kv_a / kv_b / o projections, experts, shared experts and
dense MLP in e4m3 with a weight_scale_inv per 128 x 128 block, partial blocks included, DeepSeek-V3's
quantization_config; a multi-token-prediction layer model.layers.3 with num_nextn_predict_layers 1):
greedy tokens equal and logprobs within 1e-4 of transformers' float32 run of the dequantized weights,
under the exact flags; the MTP layer skipped with one log note."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from tests.deepseek_fixtures import FP8_CONFIG, FP8_V3, save_fp8_v3
from tests.logprob_parity import assert_logprobs_close
from tests.moe_fixtures import PROMPTS, engine_run, hf_reference, make_engine

MTP_NOTE = "multi-token-prediction layer"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(fp8 dir, dense dir, engine, the MTP log notes the engine's start-up wrote)."""
    fp8, dense = save_fp8_v3(tmp_path_factory.mktemp("deepseek_fp8"))
    notes: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: notes.append(record.getMessage()) if MTP_NOTE in record.getMessage() else None
    logger = logging.getLogger("jaxserve")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        engine = make_engine(fp8, enforce_eager=True, max_num_batched_tokens=32)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    yield fp8, dense, engine, notes
    engine.shutdown()


def test_fp8_v3_equals_transformers_on_the_dequantized_weights(served):
    from jaxserve.quantization import QuantizedWeight
    from jaxserve.quantization.qweight import dense_weight
    from safetensors.numpy import load_file

    fp8, dense, engine, _ = served
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"] == FP8_CONFIG
    reference, ref_logprobs = hf_reference(dense, PROMPTS[:2])
    tokens, logprobs = engine_run(engine, PROMPTS[:2])
    assert tokens == reference
    assert_logprobs_close(logprobs, ref_logprobs, what="v3 fp8")
    layers, want = engine.model.params["layers"], load_file(dense / "model.safetensors")
    for leaf in ("wq_a", "wq_b", "wkv_a", "wo", "we_gate", "we_down", "ws_up", "w_down"):  # e4m3 on device
        w = layers[leaf]
        assert isinstance(w, QuantizedWeight) and w.scheme == "fp8_block" and w.values.dtype.itemsize == 1, leaf
    # kv_a [160, 192] in 128 x 128 blocks: 2 x 2 scales, the second row and column of blocks partial
    assert layers["wkv_a"].scales.shape == (3, 2, 2)
    np.testing.assert_array_equal(dense_weight(layers["wkv_a"])[1],
                                  want["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].T)
    # kv_b dequantized at load into the absorbed attention's W_UK / W_UV, as transformers dequantizes it
    h, nope, v = FP8_V3["num_attention_heads"], FP8_V3["qk_nope_head_dim"], FP8_V3["v_head_dim"]
    kv_b = want["model.layers.2.self_attn.kv_b_proj.weight"].reshape(h, nope + v, -1)
    np.testing.assert_array_equal(np.asarray(layers["w_uk"][2]), kv_b[:, :nope])
    np.testing.assert_array_equal(np.asarray(layers["w_uv"][2]), kv_b[:, nope:])
    for leaf in ("router", "e_bias", "attn_norm", "kv_a_norm"):  # float in the hub's checkpoint too
        assert not isinstance(layers[leaf], QuantizedWeight), leaf


def test_multi_token_prediction_layer_is_skipped_with_one_note(served):
    """V3's MTP layer (model.layers.{num_hidden_layers}: enorm, hnorm, eh_proj, shared_head, a decoder
    layer) is in the checkpoint; the engine starts, notes it once and holds num_hidden_layers layers."""
    from safetensors import safe_open

    fp8, _, engine, notes = served
    with safe_open(str(fp8 / "model.safetensors"), "np") as f:
        mtp = {k for k in f.keys() if k.startswith("model.layers.3.")}
    assert {"model.layers.3.enorm.weight", "model.layers.3.eh_proj.weight",
            "model.layers.3.shared_head.head.weight", "model.layers.3.self_attn.kv_b_proj.weight_scale_inv"} <= mtp
    assert len(notes) == 1 and "model.layers.3" in notes[0], notes
    layers = engine.model.params["layers"]
    assert engine.model.config.num_layers == 3 and layers["attn_norm"].shape[0] == layers["wkv_a"].values.shape[0] == 3


def test_other_checkpoint_formats_are_refused_naming_the_field():
    from jaxserve.engine.args import EngineArgs
    from jaxserve.models import registry
    from jaxserve.models.config import ModelConfig

    cfg = ModelConfig.from_hf({**FP8_V3, "architectures": ["DeepseekV3ForCausalLM"]})
    registry.refuse_flags(cfg, EngineArgs(model="x"), "fp8")  # block-wise fp8: served
    registry.refuse_flags(cfg, EngineArgs(model="x", quantization="fp8"), "fp8")  # --quantization naming it too
    with pytest.raises(ValueError, match="^quantization_config: not supported for DeepseekV3ForCausalLM: gptq"):
        registry.refuse_flags(cfg, EngineArgs(model="x"), "gptq")
