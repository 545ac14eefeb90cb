"""The weights API by Hugging Face name on every registered causal-LM family (issue 49; engine/weight_sync.py,
weights/hf_names.py, models/tensor_cuts.py): a tiny random checkpoint saved by transformers per family, one
engine each (Llama's own checks, and Mistral's names which are Llama's: tests/test_weight_sync.py).

Round trip, every family: get_weights() is the checkpoint's own safetensors, names (the set: Phi-3's fused
qkv_proj / gate_up_proj, the MoE families' per-expert tensors and routers, Qwen2-MoE's shared expert and its
gate, Mixtral's block_sparse_moe.experts.E.w1/w2/w3, gpt-oss's fused expert tensors, DeepSeek's dense and
MoE layers and kv_b_proj) and values (exactly: bfloat16 widened); a partial update (all of layer 0, every
other name of layer 1: some experts of a layer, some rows of a stack; numpy and jax arrays) reads back as
given; an unknown name is a ValueError naming it; update_weights_from_disk restores the checkpoint.
Since get_weights is checked against the checkpoint and its names cover every element of the tree, the
round trip puts each updated tensor in its place. Against transformers, one family per kind of name: the
update serves transformers' float32 greedy tokens and logprobs (1e-4) of the checkpoint with the same
perturbation, which differ from the unperturbed model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.logprob_parity import assert_logprobs_close

pytestmark = pytest.mark.slow

DENSE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 250, 11, 64, 9, 30]]
NUM_TOKENS = 4


def _config(family: str):
    """The family's tiny transformers config (the MoE / DeepSeek / Gemma / Phi-3 ones are the existing
    fixtures' own, with the quirks their tests exercise: a dense layer among sparse ones, ...)."""
    import transformers

    from tests import deepseek_fixtures, family_fixtures, gemma_fixtures, moe_fixtures

    if family in moe_fixtures.CHECKPOINTS:
        cls, extra = moe_fixtures.CHECKPOINTS[family]
        return getattr(transformers, cls)(**moe_fixtures.COMMON, **extra)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**moe_fixtures.GPT_OSS)
    if family in ("deepseek_v2", "deepseek_v3"):
        cls, extra = deepseek_fixtures.CHECKPOINTS[family[-2:]]
        return getattr(transformers, cls)(**deepseek_fixtures.COMMON, **extra)
    if family in family_fixtures.CHECKPOINTS:
        cls, extra = family_fixtures.CHECKPOINTS[family]
        return getattr(transformers, cls)(**{**family_fixtures.COMMON, **extra})
    if family in gemma_fixtures.CONFIGS:
        cls, fields = gemma_fixtures.CONFIGS[family]
        return getattr(transformers, cls)(**fields)
    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family]
    return getattr(transformers, cls)(**DENSE, **({"head_dim": 16} if family == "qwen3" else {}))


# (Llama, and Mistral's names which are Llama's: tests/test_weight_sync.py)
FAMILIES = ["qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "qwen3_moe",
            "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3"]
# served after the update against transformers: one family per kind of name that is not one tensor per
# leaf row (fused rows; fused interleaved experts; mixed dense / MoE layers with per-expert tensors, a
# shared expert and kv_b_proj's halves); the others' names by the round trip (Llama's update against
# transformers: tests/test_weight_sync.py)
PARITY = ["phi3", "gpt_oss", "deepseek_v3"]


def _load(path: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as float32 numpy (safetensors' numpy reader has no bfloat16)."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k).float().numpy() for k in f.keys()}


def _perturbed(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All of layer 0's tensors and every other one of layer 1's, each plus noise of its own scale."""
    rng = np.random.default_rng(0)
    layer1 = sorted(n for n in tensors if n.startswith("model.layers.1."))[::2]
    names = [n for n in tensors if n.startswith("model.layers.0.")] + layer1
    return {n: (tensors[n] + rng.standard_normal(tensors[n].shape) * (0.5 * tensors[n].std() + 0.05))
            .astype(np.float32) for n in names}


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    """The family's checkpoint, its tensors, a perturbed subset of them, and one engine serving it."""
    from tests.moe_fixtures import make_engine, save_model

    root = tmp_path_factory.mktemp(request.param)
    base = save_model(_config(request.param), root / "base")
    tensors = _load(base)
    engine = make_engine(base, max_model_len=16, max_num_batched_tokens=16, enforce_eager=True)
    yield {"family": request.param, "root": root, "base": base, "tensors": tensors, "changed": _perturbed(tensors),
           "engine": engine}
    engine.shutdown()


def _check_weights(engine, want: dict[str, np.ndarray], exact: bool = True) -> None:
    got = engine.get_weights()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=0 if exact else 1e-6, atol=0, err_msg=name)


def test_weights_by_hf_name_round_trip(case):
    """get_weights = the checkpoint (names and values); a partial update by name lands where get_weights
    reads it back (so in every leaf element's place: the names cover the whole tree); an unknown name
    is refused by name; update_weights_from_disk restores the checkpoint."""
    import jax.numpy as jnp

    engine, tensors, changed = case["engine"], case["tensors"], case["changed"]
    _check_weights(engine, tensors)  # bfloat16 values widened to float32: exact
    update = {n: (jnp.asarray(v) if i % 2 else v) for i, (n, v) in enumerate(sorted(changed.items()))}
    engine.update_weights(update, version=1)
    _check_weights(engine, {**tensors, **changed})
    unknown = "model.layers.0.mlp.experts.99.gate_proj.weight"
    with pytest.raises(ValueError, match=unknown.replace(".", r"\.")):
        engine.update_weights({unknown: np.zeros((2, 2), np.float32)})
    engine.update_weights_from_disk(case["base"])  # every tensor, numpy: assembled on the host
    _check_weights(engine, tensors)


@pytest.mark.parametrize("case", PARITY, indirect=True)
def test_update_serves_transformers_perturbed_model(case):
    """The perturbed subset by name (numpy and jax arrays) serves transformers' float32 greedy tokens and
    logprobs of the checkpoint with the same perturbation, which differ from the unperturbed model's."""
    import jax.numpy as jnp
    from safetensors.numpy import save_file

    from tests.moe_fixtures import engine_run, hf_reference

    moved = case["root"] / "perturbed"
    shutil.copytree(case["base"], moved)
    save_file({**case["tensors"], **case["changed"]}, str(moved / "model.safetensors"), metadata={"format": "pt"})
    ref, ref_base = hf_reference(moved, PROMPTS, NUM_TOKENS), hf_reference(case["base"], PROMPTS, NUM_TOKENS)
    assert ref[0] != ref_base[0], "the perturbation must change transformers' tokens"
    engine = case["engine"]
    engine.update_weights(case["tensors"])  # the checkpoint whole (host path), then the perturbed subset
    changed = sorted(case["changed"].items())
    engine.update_weights({n: (v if i % 2 else jnp.asarray(v)) for i, (n, v) in enumerate(changed)})
    tokens, logprobs = engine_run(engine, PROMPTS, NUM_TOKENS)
    assert tokens == ref[0], case["family"]
    assert_logprobs_close(logprobs, ref[1], what=case["family"])
