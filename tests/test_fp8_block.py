"""Block-wise FP8 checkpoints (quant_method fp8, weight_block_size [128, 128], weight_scale_inv: the
format of Qwen3-*-FP8 and DeepSeek-V3) made by transformers' FineGrainedFP8Config from a tiny random
Llama: the e4m3 values stay in device memory as an fp8_block QuantizedWeight, and jaxserve's greedy
tokens equal those of transformers' own dequantized model (FineGrainedFP8Config(dequantize=True))
with the exact float32 flags."""

from __future__ import annotations

import json

import numpy as np
import pytest

import torch
import transformers

import jax.numpy as jnp  # noqa: E402

from jaxserve.quantization import QuantizedWeight  # noqa: E402
from jaxserve.quantization.formats import detect  # noqa: E402
from jaxserve.quantization.qweight import dense_weight, fp8_block  # noqa: E402
from tests import quant_fixtures as qf  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [8, 1, 60, 300]]
NUM_GREEDY = 8
EXACT = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for p in model.parameters():  # larger than the default init so the logits spread out
        p.data.mul_(4.0 if p.ndim == 2 else 1.0)
    root = tmp_path_factory.mktemp("fp8_block")
    model.save_pretrained(str(root / "float"))
    qf.finegrained_fp8_checkpoint(str(root / "float"), str(root / "fp8"))
    return root / "fp8", qf.finegrained_fp8_reference(str(root / "fp8"))


def test_checkpoint_is_the_hub_layout(checkpoint):
    path, _ = checkpoint
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    spec = detect({"quantization_config": qc}, None)
    assert spec.scheme == "fp8_block" and spec.block_size == (128, 128)
    with pytest.raises(ValueError, match="weight_block_size"):
        detect({"quantization_config": {**qc, "weight_block_size": [128]}}, None)


@pytest.mark.warmup  # holds 0 compilations after warm-up
def test_greedy_tokens_equal_transformers_dequantized(checkpoint):
    from jaxserve import LLM, SamplingParams

    path, ref = checkpoint
    llm = LLM(str(path), max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, progress=False, **EXACT)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NUM_GREEDY, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.get_stats().num_compilations_after_warmup == 0
    for out, prompt in zip(outs, PROMPTS):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=NUM_GREEDY, do_sample=False)[0, len(prompt):]
        assert list(out.outputs[0].token_ids) == want.tolist()
    layers = llm.llm_engine.model.params["layers"]
    wq, w_down = layers["wq"], layers["w_down"]
    assert isinstance(wq, QuantizedWeight) and wq.scheme == "fp8_block"
    assert wq.values.dtype == jnp.float8_e4m3fn and wq.values.shape == (2, 256, 256) and wq.scales.shape == (2, 2, 2)
    assert w_down.values.shape == (2, 512, 256) and w_down.scales.shape == (2, 4, 2)
    # The loaded weight is transformers' dequantized one, exactly.
    np.testing.assert_array_equal(dense_weight(wq)[0], ref.model.layers[0].self_attn.q_proj.weight.detach().numpy().T)


def test_ragged_blocks_and_bad_scales():
    # A [200, 300] weight in [128, 128] blocks: the last block row and column are partial (DeepSeek's
    # cdiv layout); the dequantized weight is each value times its block's scale.
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    scale_inv = (rng.random((2, 3)) + 0.5).astype(np.float32)
    values = np.asarray(jnp.asarray(w).astype(jnp.float8_e4m3fn))
    qw = fp8_block(values, scale_inv, (128, 128))
    want = values.astype(np.float32) * np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:200, :300]
    np.testing.assert_array_equal(dense_weight(jax_tree(qw)), want.T)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block(values, scale_inv[:1], (128, 128))


def jax_tree(w):
    import jax

    return jax.tree.map(jnp.asarray, w)
