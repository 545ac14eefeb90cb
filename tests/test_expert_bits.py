"""jaxserve/weights/expert_bits.py: which engines keep a bfloat16 checkpoint's MoE experts as their
bits, and the start-up conversion of float32 experts that hold bfloat16 values (a LoadedModel passed
in). On a CPU without bfloat16 dots the engine never takes this path (test_moe_parity skips there),
so the conversion and the report are checked here directly, against numpy's bfloat16 (ml_dtypes)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig
from jaxserve.models.expert_weights import BF16_BITS, EXPERT_STACKS
from jaxserve.weights import expert_bits
from jaxserve.weights.loader import LoadedModel


def _model(stacks: dict[str, np.ndarray]) -> LoadedModel:
    params = {"embed": jnp.zeros((4, 2), jnp.float32),
              "layers": {"wq": jnp.ones((2, 2, 2), jnp.float32), **{k: jnp.asarray(v) for k, v in stacks.items()}}}
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=4, hidden_size=2, intermediate_size=2, num_layers=2, num_heads=1,
                      num_kv_heads=1, head_dim=2)
    return LoadedModel(config=cfg, params=params, tokenizer=None, name="m", path=Path("."))


def test_keeps_bf16_experts_only_with_bfloat16_dots_on_the_xla_path():
    assert expert_bits.keeps_bf16_experts(64, "xla") and expert_bits.keeps_bf16_experts(64, "auto")  # auto: xla on CPU
    assert not expert_bits.keeps_bf16_experts(0, "xla")  # no bfloat16 dots (a parallel run, --dtype float32)
    assert not expert_bits.keeps_bf16_experts(64, "pallas")  # the Pallas kernels take float stacks


def test_float32_experts_of_bfloat16_values_become_their_bits():
    rng = np.random.default_rng(0)
    values = {k: rng.standard_normal((2, 4, 8, 16)).astype(jnp.bfloat16).astype(np.float32) for k in EXPERT_STACKS}
    model = _model(values)
    assert expert_bits.expert_width(model.params) is None and expert_bits.bf16_experts_note(model.params) == ""
    kept = expert_bits.with_bf16_experts(model)
    for k, v in values.items():
        got = kept.params["layers"][k]
        assert got.dtype == BF16_BITS and 2 * got.nbytes == v.nbytes
        np.testing.assert_array_equal(np.asarray(got), v.astype(jnp.bfloat16).view(np.uint16))
    assert kept.params["layers"]["wq"] is model.params["layers"]["wq"]  # other weights as they are
    assert expert_bits.expert_width(kept.params) == 2
    mib = sum(v.nbytes for v in values.values()) / 2 / 2**20
    assert expert_bits.bf16_experts_note(kept.params) == (
        f"; MoE experts kept as the checkpoint's bfloat16: {mib:.1f} MiB, half of float32's "
        f"(--dtype float32 keeps float32)")


def test_experts_bfloat16_would_round_stay_float32():
    rng = np.random.default_rng(1)
    values = {k: rng.standard_normal((2, 4, 8, 16)).astype(jnp.bfloat16).astype(np.float32) for k in EXPERT_STACKS}
    values["we_down"] = values["we_down"] + np.float32(1e-3)  # not a bfloat16 value: converting would round it
    model = _model(values)
    assert expert_bits.with_bf16_experts(model) is model
