"""jaxserve.models.forward (the training forward, models/training.py) against transformers in float32:
logits within 1e-4 on tiny random models of the dense families (Llama, Mistral with a sliding window
shorter than the sequence), a MoE (Qwen3-MoE: a dense layer between sparse ones), gpt-oss (attention
sinks, alternating sliding and full layers, YaRN) and Gemma 2 (its own decoder: soft caps, scaled
embeddings, a window), with right padding under an attention mask; and
jax.grad through it equal to torch's autograd of the same loss (a dense projection, the MoE router)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import forward, token_logprobs
from jaxserve.weights.loader import load_model
from tests.gemma_fixtures import save_gemma
from tests.moe_fixtures import save_checkpoint, save_gpt_oss, save_model

TOL = 1e-4
BATCH, LENGTH, SHORT = 2, 14, 9  # row 1 holds SHORT real tokens, right-padded with 0s (masked)


def _dense_config(name: str):
    import transformers

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=name == "llama")
    if name == "mistral":  # a window shorter than the rows: the window is exercised
        return transformers.MistralConfig(**common, sliding_window=5)
    return transformers.LlamaConfig(**common)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("training_forward")
    out = {name: save_model(_dense_config(name), root / name) for name in ("llama", "mistral")}
    out["qwen3_moe"] = save_checkpoint("qwen3_moe", root / "qwen3_moe")
    out["gpt_oss"] = save_gpt_oss(root / "gpt_oss")
    out["gemma2"] = save_gemma("gemma2", root / "gemma2")
    return out


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 256, (BATCH, LENGTH)).astype(np.int32)
    mask = np.ones((BATCH, LENGTH), np.int32)
    mask[1, SHORT:] = 0
    ids[1, SHORT:] = 0
    positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (BATCH, LENGTH)).copy()
    return ids, positions, mask


def _hf(path: Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _real(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.concatenate([x[0], x[1, :SHORT]]) if mask[1, SHORT:].sum() == 0 else x.reshape(-1, x.shape[-1])


def _hf_logits(path: Path, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, grad: bool = False):
    import torch

    hf = _hf(path)
    with torch.set_grad_enabled(grad):
        logits = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions, dtype=torch.long)).logits
    return hf, logits


@pytest.mark.parametrize("name", ["mistral", "gpt_oss", "gemma2"])
def test_logits_equal_transformers_float32(checkpoints, name):
    ids, positions, mask = _batch(1)
    model = load_model(str(checkpoints[name]), dtype="float32", progress=False)
    ours = jax.jit(functools.partial(forward, config=model.config))(model.params, ids, positions, attention_mask=mask)
    ref = _hf_logits(checkpoints[name], ids, positions, mask)[1].numpy()
    assert ours.shape == ref.shape and ours.dtype == jnp.float32
    np.testing.assert_allclose(_real(np.asarray(ours), mask), _real(ref, mask), atol=TOL, rtol=0)


@pytest.mark.parametrize("name, leaf, hf_name", [
    ("llama", "wq", "model.layers.1.self_attn.q_proj.weight"),
    ("qwen3_moe", "router", "model.layers.0.mlp.gate.weight"),  # through the routing weights
])
def test_logits_and_grad_equal_transformers(checkpoints, name, leaf, hf_name):
    """One program: the logits (within 1e-4 of transformers' float32) and the gradient of the real
    tokens' summed logprobs, finite everywhere, and for one [in, out] leaf of one layer equal to
    torch's autograd of the same loss for the same [out, in] tensor (transposed)."""
    import torch

    ids, positions, mask = _batch(2)
    model = load_model(str(checkpoints[name]), dtype="float32", progress=False)
    layer = int(hf_name.split(".")[2])

    def loss(params):
        logits = forward(params, ids, positions, config=model.config, attention_mask=mask)
        return jnp.sum(token_logprobs(logits, ids) * mask[:, 1:]), logits

    grads, logits = jax.jit(jax.grad(loss, has_aux=True))(model.params)
    hf, ref_logits = _hf_logits(checkpoints[name], ids, positions, mask, grad=True)
    np.testing.assert_allclose(_real(np.asarray(logits), mask), _real(ref_logits.detach().numpy(), mask),
                               atol=TOL, rtol=0)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    if name == "qwen3_moe":  # the experts are trained too (the grouped path's gradient reaches the stacks)
        assert float(jnp.abs(grads["layers"]["we_gate"]).max()) > 0
    targets = torch.tensor(ids[:, 1:, None], dtype=torch.long)
    logp = torch.log_softmax(ref_logits[:, :-1], -1).gather(-1, targets)[..., 0]
    (logp * torch.tensor(mask[:, 1:])).sum().backward()
    ref = dict(hf.named_parameters())[hf_name].grad.numpy().T
    ours = np.asarray(grads["layers"][leaf][layer])
    scale = np.abs(ref).max()
    assert scale > 0
    np.testing.assert_allclose(ours, ref, atol=1e-4 * scale, rtol=0)


def test_shapes_refused_naming_the_field(checkpoints):
    model = load_model(str(checkpoints["llama"]), dtype="float32", progress=False)
    ids = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="positions"):
        forward(model.params, ids, np.zeros((2, 5), np.int32), config=model.config)
    with pytest.raises(ValueError, match="attention_mask"):
        forward(model.params, ids, ids, config=model.config, attention_mask=np.ones((2, 3)))
