"""Quantized HF checkpoints (AWQ, GPTQ, compressed-tensors, fp8) on tiny random Llama and Qwen2 models.

Each checkpoint is written once per session (tests/quant_fixtures.py says which library
made which format). The reference is transformers on PyTorch with every Linear set to the
weight the quantized one stands for (the library's own decompression for
compressed-tensors, the unpacked integers times their scales for GPTQ/AWQ/fp8).
For the W8A8 schemes the reference also quantizes each Linear's input as vLLM does (a
forward pre-hook: per-token int8 or float8_e4m3fn, or the checkpoint's static fp8
scale). Every case matches the reference within TOLERANCE of the logits' range and the
greedy tokens agree: weight only to float32 rounding; W8A8 looser because XLA and
torch may round x / scale differently (XLA can multiply by the reciprocal), and one
activation crossing a rounding boundary moves by a whole step (1/127 of its row's max
in int8, 1/16 of its own magnitude in fp8's 3-bit mantissa; measured: 2.7% of the range
for vLLM-style fp8 with per-tensor weight scales on the llama model).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import torch
import transformers

import jax.numpy as jnp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from jaxserve.quantization import QuantizedWeight  # noqa: E402
from jaxserve.weights.loader import load_model  # noqa: E402
from tests import quant_fixtures as qf  # noqa: E402
from tests.paged_helpers import paged_logits  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [8, 1, 60, 300]]
NUM_GREEDY = 6
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name -> (quantization_config, per-Linear maker (w [out, in], rng) -> (tensors, reference weight),
#          how the reference quantizes activations: False (weight only), "int8", "fp8", "fp8_static")
CASES = {
    "gptq4_sym": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True},
                  lambda w, r: qf.gptq_linear(w, 4, 64, True, False, r), False),
    "gptq4_actorder_asym": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False},
                            lambda w, r: qf.gptq_linear(w, 4, 64, False, True, r), False),
    "gptq8": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True},
              lambda w, r: qf.gptq_linear(w, 8, 128, True, False, r), False),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
            lambda w, r: qf.awq_linear(w, 64, r), False),
    "ct_w4a16": (qf.ct_config("W4A16", 64), lambda w, r: qf.ct_linear(w, "W4A16", 64), False),
    "ct_w4a16_asym": (qf.ct_config("W4A16", 64, False), lambda w, r: qf.ct_linear(w, "W4A16", 64, False), False),
    "ct_w8a8_int8": (qf.ct_config("W8A8"), lambda w, r: qf.ct_linear(w, "W8A8"), "int8"),
    "ct_fp8_dynamic": (qf.ct_config("FP8_DYNAMIC"), lambda w, r: qf.ct_linear(w, "FP8_DYNAMIC"), "fp8"),
    "fp8_static": ({"quant_method": "fp8", "activation_scheme": "static"}, lambda w, r: qf.fp8_linear(w, True),
                   "fp8_static"),
    "fp8_dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, lambda w, r: qf.fp8_linear(w, False),
                    "fp8"),
}
TOLERANCE = {False: 1e-4, "int8": 2e-3, "fp8": 5e-2, "fp8_static": 5e-2}
FAMILIES = {
    "llama": transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=False),
    "qwen2": transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def float_models():
    torch.manual_seed(0)
    models = {}
    for name, cfg in FAMILIES.items():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        for p in model.parameters():  # larger than the default init so the logits spread out
            p.data.mul_(4.0 if p.ndim == 2 else 1.0)
        models[name] = model
    return models


@pytest.fixture(scope="session")
def checkpoints(float_models, tmp_path_factory):
    """(family, case) -> (checkpoint dir, reference HF model)."""
    cache: dict = {}

    def make(family: str, case: str):
        if (family, case) in cache:
            return cache[family, case]
        qconfig, maker, _ = CASES[case]
        base = float_models[family]
        ref = transformers.AutoModelForCausalLM.from_config(base.config, dtype=torch.float32).eval()
        ref.load_state_dict(base.state_dict())
        rng = np.random.default_rng(1)
        tensors = {k: v.contiguous() for k, v in base.state_dict().items()}
        for i in range(base.config.num_hidden_layers):
            for lin in LINEARS:
                kind = "self_attn" if lin[0] in "qkvo" else "mlp"
                prefix = f"model.layers.{i}.{kind}.{lin}"
                w = tensors.pop(f"{prefix}.weight").numpy()
                quantized, ref_w = maker(w, rng)
                tensors.update({f"{prefix}.{k}": torch.as_tensor(np.asarray(v) if not torch.is_tensor(v) else v)
                                for k, v in quantized.items()})
                ref.get_submodule(prefix).weight.data = torch.from_numpy(np.ascontiguousarray(ref_w))
                if CASES[case][2]:
                    ref.get_submodule(prefix).register_forward_pre_hook(_act_quant(CASES[case][2], quantized))
            if case == "fp8_static":  # vLLM's fp8 KV cache scales (a float pool computes the same function)
                tensors.update({f"model.layers.{i}.self_attn.{n}": torch.tensor(np.float32(v))
                                for n, v in (("k_scale", 2.0), ("v_scale", 0.5))})
        if base.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        path = tmp_path_factory.mktemp(f"{family}_{case}")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        config = {**base.config.to_dict(), "architectures": [type(base).__name__], "quantization_config": qconfig}
        (path / "config.json").write_text(json.dumps(config))
        cache[family, case] = (path, ref)
        return cache[family, case]

    return make


def _act_quant(kind: str, tensors: dict):
    """A pre-hook quantizing the Linear's input as the W8A8 scheme does at run time."""
    def hook(module, args):
        x = args[0]
        if kind == "fp8_static":
            scale = tensors["input_scale"].float()
        else:
            scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / (127.0 if kind == "int8" else 448.0)
        if kind == "int8":
            return (torch.round(x / scale).clamp(-127, 127) * scale,)
        return ((x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale,)
    return hook


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """NUM_GREEDY greedy tokens and the logits at the last prompt token and each generated one."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NUM_GREEDY):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].numpy()
    return ids[len(prompt):], logits


@pytest.mark.parametrize("family,case", [(f, c) for c in CASES for f in FAMILIES
                                         if f == "llama" or c in ("gptq4_actorder_asym", "awq", "ct_w4a16")])
def test_checkpoint_matches_dequantized_reference(checkpoints, family: str, case: str) -> None:
    path, ref = checkpoints(family, case)
    loaded = load_model(str(path), dtype="float32", progress=False)
    assert loaded.quantization == CASES[case][0]["quant_method"]
    wq = loaded.params["layers"]["wq"]
    assert isinstance(wq, QuantizedWeight) and wq.shape == (2, 256, 256)
    assert ("k_scale" in loaded.params["layers"]) == (case == "fp8_static")
    greedy, want = zip(*(_hf_greedy(ref, p) for p in PROMPTS))
    got = paged_logits(loaded.params, loaded.config, PROMPTS, [g[:-1] for g in greedy])
    tol = TOLERANCE[CASES[case][2]]
    for g, w, tokens in zip(got, want, greedy):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())
        assert list(g.argmax(-1)) == list(tokens)


def test_4bit_weights_stay_packed(checkpoints) -> None:
    path, _ = checkpoints("llama", "gptq4_actorder_asym")
    wq = load_model(str(path), dtype="bfloat16", progress=False).params["layers"]["wq"]
    assert wq.values.dtype == jnp.uint8 and wq.values.shape == (2, 128, 256)  # two values a byte
    assert wq.perm is not None and wq.scales.dtype == jnp.bfloat16


def test_quantization_flag_checks_the_checkpoint(checkpoints, float_models, tmp_path) -> None:
    path, _ = checkpoints("llama", "awq")
    assert load_model(str(path), dtype="float32", progress=False, quantization="awq").quantization == "awq"
    with pytest.raises(ValueError, match="'gptq' was asked for but the checkpoint is quantized with 'awq'"):
        load_model(str(path), dtype="float32", progress=False, quantization="gptq")
    config = json.loads((path / "config.json").read_text())
    for method in ("bitsandbytes", "exl2", "hqq"):
        bad = tmp_path / method
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": method}}))
        with pytest.raises(ValueError, match=f"'{method}' is not supported; supported checkpoint methods: "
                                             "awq, gptq, compressed-tensors, fp8"):
            load_model(str(bad), dtype="float32", progress=False)


@pytest.mark.warmup  # holds 0 compilations after warm-up
@pytest.mark.parametrize("case", ["gptq4_actorder_asym", "ct_fp8_dynamic"])
def test_engine_serves_a_quantized_checkpoint_without_recompiling(checkpoints, case) -> None:
    from jaxserve import LLM, SamplingParams

    path, ref = checkpoints("llama", case)
    # compressed-tensors named explicitly (as `--quantization compressed-tensors`): it used to raise
    # KeyError in worker/sizing.py while auto-detection loaded the same checkpoint.
    method = "compressed-tensors" if case.startswith("ct_") else None
    llm = LLM(str(path), dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32,
              kv_cache_dtype="auto", block_size=16, quantization=method,
              progress=False)  # float32 KV: held to the library's greedy ids
    engine = llm.llm_engine
    assert "MiB per device" in engine.startup_report() and CASES[case][0]["quant_method"] in engine.startup_report()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NUM_GREEDY, ignore_eos=True), use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS):
        assert list(out.outputs[0].token_ids) == _hf_greedy(ref, prompt)[0]
    assert engine.get_stats().num_compilations_after_warmup == 0


def test_4bit_linear_weights_are_under_0_3x_bfloat16(checkpoints) -> None:
    for case in ("gptq4_sym", "awq", "ct_w4a16"):
        path, _ = checkpoints("llama", case)
        layers = load_model(str(path), dtype="bfloat16", progress=False).params["layers"]
        linear = [layers[k] for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
        stored = sum(w.nbytes for w in linear)
        bf16 = sum(2 * int(np.prod(w.shape)) for w in linear)
        assert stored <= 0.3 * bf16, (case, stored / bf16)


def test_fp8_quantize_on_load_of_a_float_checkpoint(float_models, tmp_path) -> None:
    from jaxserve import LLM, SamplingParams

    model = float_models["llama"]
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="'gptq' needs a checkpoint quantized with it"):
        load_model(str(tmp_path), dtype="float32", progress=False, quantization="gptq")
    llm = LLM(str(tmp_path), dtype="float32", quantization="fp8", max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=32, progress=False)
    params = llm.llm_engine.model.params
    assert params["layers"]["wq"].values.dtype == jnp.float8_e4m3fn and params["layers"]["wq"].scales.shape == (2, 1, 256)
    assert "lm_head" in params and not isinstance(params["lm_head"], QuantizedWeight)  # as vLLM: head unquantized
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NUM_GREEDY, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NUM_GREEDY for o in outs)
    # Against the float model, teacher-forced on its greedy tokens (this random model's logits are
    # too flat for greedy agreement to mean much): e4m3 weights and activations keep the direction.
    greedy, want = zip(*(_hf_greedy(model, p) for p in PROMPTS))
    got = paged_logits(params, llm.llm_engine.model.config, PROMPTS, [g[:-1] for g in greedy])
    for g, w in zip(got, want):
        cos = (g * w).sum(-1) / (np.linalg.norm(g, axis=-1) * np.linalg.norm(w, axis=-1))
        assert cos.min() > 0.97, cos  # measured: 0.979 to 0.991
