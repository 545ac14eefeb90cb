"""`jaxserve convert MODEL OUT` round trips: the Orbax checkpoint loads back to bitwise-identical params,
identical logits through the paged cache, the same config and the same tokenizer, for a tiny random HF
model and for the real default model (from its GGUF)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxserve import cli
from jaxserve.weights.loader import CHECKPOINT_MARKER, load_model
from tests.paged_helpers import paged_logits

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n", "  héllo, wörld! 12345 🙂",
         "<|im_start|>user\nHi<|im_end|>\n"]


def convert(src, out, *extra: str) -> int:
    return cli.main(["convert", str(src), str(out), *extra])


def assert_same_params(a, b) -> None:
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def assert_same_logits(a, b, vocab_size: int, num_decode_steps: int = 3) -> None:
    """A ragged prefill of two prompts, then batched decode steps, through the paged cache."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in (9, 3)]
    conts = [rng.integers(0, vocab_size, num_decode_steps).tolist() for _ in prompts]
    for x, y in zip(paged_logits(a.params, a.config, prompts, conts), paged_logits(b.params, b.config, prompts, conts)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("family", ["llama31_rope_scaling"])
def test_tiny_hf_model_round_trip(family, tmp_path, capsys):
    from tests.test_model_parity import make_hf_model  # torch

    make_hf_model(family, tmp_path / "hf")
    assert convert(tmp_path / "hf", tmp_path / "ckpt") == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "ckpt" / CHECKPOINT_MARKER).is_file()
    source = load_model(str(tmp_path / "hf"), dtype="float32", progress=False)
    converted = load_model(str(tmp_path / "ckpt"), dtype="float32", progress=False)
    assert converted.config == source.config
    assert converted.tokenizer is None  # save_pretrained of a bare model writes no tokenizer
    assert_same_params(source.params, converted.params)
    assert_same_logits(source, converted, source.config.vocab_size)


def test_convert_bfloat16(tmp_path):
    from tests.test_model_parity import make_hf_model

    make_hf_model("qwen3_qknorm", tmp_path / "hf")
    assert convert(tmp_path / "hf", tmp_path / "ckpt", "--dtype", "bfloat16") == 0
    source = load_model(str(tmp_path / "hf"), dtype="bfloat16", progress=False)
    converted = load_model(str(tmp_path / "ckpt"), dtype="bfloat16", progress=False)
    assert_same_params(source.params, converted.params)


def test_convert_refuses_a_non_empty_output(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("also mine")
    missing_source = tmp_path / "no-such-model"  # refused before the source is even looked at
    assert convert(missing_source, tmp_path / "out") == 1
    assert "is not empty" in capsys.readouterr().err
    assert convert(missing_source, tmp_path / "file") == 1
    assert "not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]
    assert (tmp_path / "file").read_text() == "also mine"


@pytest.fixture(scope="module")
def converted_default(tmp_path_factory, default_gguf):
    out = tmp_path_factory.mktemp("default-ckpt") / "SmolLM2-135M-Instruct"
    assert convert(default_gguf, out) == 0
    return load_model(str(out), dtype="float32", progress=False)


def test_default_model_params_and_config(converted_default, jax_default_model):
    assert converted_default.config == jax_default_model.config
    marker = json.loads((converted_default.path / CHECKPOINT_MARKER).read_text())
    assert marker["config"]["architecture"] == "LlamaForCausalLM"
    assert_same_params(jax_default_model.params, converted_default.params)


def test_default_model_logits(converted_default, jax_default_model):
    # Prefill only: each decode shape would be one more compilation of the 30-layer model.
    assert_same_logits(jax_default_model, converted_default, jax_default_model.config.vocab_size, 0)


def test_default_model_tokenizer(converted_default, jax_default_model):
    src, dst = jax_default_model.tokenizer, converted_default.tokenizer
    assert dst is not None
    for text in TEXTS:
        assert dst.encode(text) == src.encode(text), text
        assert dst.decode(dst.encode(text)) == src.decode(src.encode(text))
    assert dst.chat_template and dst.chat_template == src.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert (dst.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == src.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (dst.eos_token, dst.bos_token, len(dst)) == (src.eos_token, src.bos_token, len(src))
