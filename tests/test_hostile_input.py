"""Structured outputs and tool calls under attack: 1,000 distinct schemas do not grow the compiled-grammar
cache (or the process) without bound, a grammar built to be expensive stops at llguidance's limits
in bounded time, and tool-call parsing of long or malformed model output is bounded in time and
never raises (the text stays content)."""

from __future__ import annotations

import os
import time

import pytest

from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.core.structured_output import GRAMMAR_CACHE_SIZE, StructuredOutputManager
from jaxserve.entrypoints.openai.tool_calls import TOOL_PARSERS, parse_auto

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def manager():
    from jaxserve.weights.gguf_tokenizer import load_gguf_tokenizer
    from jaxserve.weights.loader import default_model_path

    m = StructuredOutputManager(load_gguf_tokenizer(None, default_model_path()), VOCAB, (EOS,))
    yield m
    m.shutdown()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _schema(k: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"type": "object", "properties": {f"field_{k}": {"type": "integer"}},
                                         "required": [f"field_{k}"]})


def test_a_thousand_distinct_schemas_keep_the_cache_and_the_process_bounded(manager) -> None:
    for k in range(300):  # warm: the tokenizer's trie, the pool's threads, allocator arenas
        manager.compile(_schema(k)).result(timeout=30)
    after_warm = _rss_bytes()
    for k in range(300, 1000):
        manager.compile(_schema(k)).result(timeout=30)
    assert len(manager._cache) == GRAMMAR_CACHE_SIZE
    growth = _rss_bytes() - after_warm
    assert growth < 64 * 2**20, f"{growth / 2**20:.0f} MiB for 700 more schemas"
    assert manager.compile(_schema(999)).result(timeout=1) is manager.compile(_schema(999)).result()  # cached


def test_an_expensive_grammar_stops_in_bounded_time(manager) -> None:
    """Nested bounded repetitions: a huge automaton if built eagerly; llguidance's fuel ends it."""
    start = time.monotonic()
    future = manager.compile(StructuredOutputsParams(regex="((a|b){1,64}(c|d){1,64}){1,64}"))
    try:
        future.result(timeout=30)
    except ValueError as exc:  # past the limits: the request alone is refused
        assert str(exc).startswith("structured_outputs")
    assert time.monotonic() - start < 30


HOSTILE = ["<tool_call>" + " " * 200_000 + "x", "<tool_call>" * 20_000, "[" * 100_000, "{" * 100_000,
           '{"name": "f", "arguments": ' + "[" * 100_000, "[TOOL_CALLS]" + "[" * 100_000,
           "<|python_tag|>" + '{"name": "f"};' * 20_000, "<tool_call>{" + '"a":' * 50_000 + "</tool_call>"]


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_tool_call_parsing_of_hostile_output_is_bounded(parser: str) -> None:
    start = time.monotonic()
    for text in HOSTILE:
        content, calls = parse_auto(parser, text)
        assert content is None or isinstance(content, str)
    assert time.monotonic() - start < 5
