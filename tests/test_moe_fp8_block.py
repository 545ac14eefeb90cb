"""Block-wise FP8 MoE checkpoints made by transformers' FineGrainedFP8Config from a tiny random
Qwen3-MoE (a dense layer between sparse ones): the experts stay e4m3 with their block scales in
device memory (a QuantizedWeight [L, E, K, N], dequantized per touched expert inside the expert
matmuls), and jaxserve's greedy tokens equal transformers' own dequantized float32 model's
(FineGrainedFP8Config(dequantize=True)) with the exact float32 flags, on one device and TP 2.

transformers 5.25's save_pretrained writes the experts per expert (`experts.{e}.gate_proj.weight`,
e4m3) but their scales fused per layer (`experts.gate_up_proj_scale_inv` [E, 2I / b, H / b],
`experts.down_proj_scale_inv`); hub checkpoints (Qwen3-30B-A3B-FP8) carry a `weight_scale_inv` per
expert Linear. Both are read; the second is made here from the first by splitting the scales.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import torch
import transformers

import jax.numpy as jnp  # noqa: E402

from jaxserve.quantization import QuantizedWeight  # noqa: E402
from jaxserve.quantization.qweight import dense_weight  # noqa: E402
from tests import quant_fixtures as qf  # noqa: E402
from tests.moe_fixtures import PROMPTS, engine_greedy, make_engine  # noqa: E402

BLOCK = (32, 32)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                      mlp_only_layers=[1], norm_topk_prob=False, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # larger weights than the default init, so the logits are far from uniform
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    root = tmp_path_factory.mktemp("moe_fp8")
    model.to(torch.bfloat16).save_pretrained(root / "float")
    qf.finegrained_fp8_checkpoint(str(root / "float"), str(root / "fp8"), BLOCK)
    # transformers 5.25 does not read its own fused expert scales back (they load as UNEXPECTED and
    # the experts stay e4m3), so its reference is the hub layout of the same values
    ref = qf.finegrained_fp8_reference(str(_per_expert_scales(root / "fp8", root / "per_expert")))
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    return root, ref, want


def _per_expert_scales(src: Path, out: Path) -> Path:
    """The hub's layout: each expert Linear with its own weight_scale_inv (the fused scales split)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj_scale_inv")]:
        base = name.removesuffix("gate_up_proj_scale_inv")
        fused, down = tensors.pop(name), tensors.pop(base + "down_proj_scale_inv")
        half = fused.shape[1] // 2
        for e in range(fused.shape[0]):
            tensors[f"{base}{e}.gate_proj.weight_scale_inv"] = fused[e, :half].contiguous()
            tensors[f"{base}{e}.up_proj.weight_scale_inv"] = fused[e, half:].contiguous()
            tensors[f"{base}{e}.down_proj.weight_scale_inv"] = down[e].contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix == ".json":
            (out / f.name).write_text(f.read_text())
    return out


def test_experts_stay_fp8_and_tokens_equal_transformers(checkpoint):
    root, ref, want = checkpoint
    qc = json.loads((root / "fp8" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == list(BLOCK)
    engine = make_engine(root / "fp8")
    assert engine_greedy(engine) == want
    layers = engine.model.params["layers"]
    we_gate, we_down = layers["we_gate"], layers["we_down"]
    assert isinstance(we_gate, QuantizedWeight) and we_gate.scheme == "fp8_block"
    # the 2 sparse layers' experts only (layer 1 is dense: mlp_only_layers), [L_sparse, E, I, H]
    assert we_gate.values.dtype == jnp.float8_e4m3fn and we_gate.values.shape == (2, 8, 64, 128)
    assert we_gate.scales.shape == (2, 8, 2, 4) and we_down.values.shape == (2, 8, 128, 64)
    assert isinstance(layers["w_gate"], QuantizedWeight)  # the dense layer's MLP too, and only its own
    assert layers["w_gate"].values.shape[0] == 1
    hf = ref.model.layers[2].mlp.experts  # the loaded experts are transformers' dequantized ones
    np.testing.assert_array_equal(dense_weight(we_down)[1], hf.down_proj.detach().numpy())
    hf_gate = hf.gate_up_proj.detach().numpy()[:, :64]
    np.testing.assert_array_equal(dense_weight(we_gate)[0], ref.model.layers[0].mlp.experts.gate_up_proj.detach()
                                  .numpy()[:, :64])
    np.testing.assert_array_equal(dense_weight(we_gate)[1], hf_gate)
    engine.shutdown()


def test_hub_layout_loads_the_same_weights(checkpoint):
    """Per-expert weight_scale_inv (the hub's layout) loads into the same device weights."""
    from jaxserve.weights.loader import load_model

    root, _, _ = checkpoint
    fused = load_model(str(root / "fp8"), "float32", progress=False).params["layers"]
    hub = load_model(str(root / "per_expert"), "float32", progress=False).params["layers"]
    for leaf in ("we_gate", "we_up", "we_down", "w_gate"):
        np.testing.assert_array_equal(dense_weight(fused[leaf]), dense_weight(hub[leaf]))


TP_SCRIPT = r'''
import json, sys
from tests.moe_fixtures import engine_greedy, make_engine
for path, mode in zip(sys.argv[1::2], sys.argv[2::2]):
    engine = make_engine(path, tensor_parallel_size=2, enable_expert_parallel=mode == "ep")
    w = engine.model.params["layers"]["we_gate"]
    print(json.dumps({"mode": mode, "tokens": engine_greedy(engine), "spec": str(w.values.sharding.spec),
                      "scales_spec": str(w.scales.sharding.spec)}))
    engine.shutdown()
'''


@pytest.mark.multidevice
def test_tensor_parallel_2_tokens_equal_transformers(checkpoint):
    """TP 2 (fake CPU devices, one subprocess): each expert's intermediate axis split, values and
    block scales alike (transformers' fused scales); with --enable-expert-parallel (the hub's
    per-expert scales) the expert axis."""
    root, _, want = checkpoint
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    args = [str(root / "fp8"), "tp", str(root / "per_expert"), "ep"]
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert [r["mode"] for r in results] == ["tp", "ep"]
    for got in results:
        assert got["tokens"] == want
        split = "None, 'model', None, None" if got["mode"] == "ep" else "None, None, 'model'"
        assert split in got["spec"] and split in got["scales_spec"], got
