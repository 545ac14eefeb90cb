"""The grammar manager (core/structured_output.py) on the default model's real tokenizer: grammars
compile off the caller's thread and are cached, bitmask rows follow the runner's row order (drafts
included, matchers rolled back), allowed_token_ids / bad_words rows, and the scheduler keeps a
request whose grammar compiles in `waiting` without holding back the others."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import llguidance.numpy as llnp
import numpy as np
import pytest

from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.scheduler_output import ScheduledRequest
from jaxserve.core.structured_output import StructuredOutputManager, validate_structured_outputs

VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.weights.gguf_tokenizer import load_gguf_tokenizer
    from jaxserve.weights.loader import default_model_path

    return load_gguf_tokenizer(None, default_model_path())


@pytest.fixture
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, VOCAB, (EOS,))
    yield m
    m.shutdown()


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def wait_ready(m: StructuredOutputManager, rid: str) -> None:
    deadline = time.monotonic() + 60
    while not m.is_ready(rid):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def sched(rid: str, drafts: list[int] = (), sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(rid, [5] + list(drafts), 0, [], sample, num_drafts=len(drafts))


def params(**so) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(**so))


def test_json_grammar_walks_to_eos(manager, tokenizer):
    manager.add_request("r", params(json=SCHEMA))
    wait_ready(manager, "r")
    text = '{"a":12}'
    for token in tokenizer.encode(text, add_special_tokens=False):
        bitmask = manager.fill_bitmask([sched("r")])
        assert bitmask.shape == (1, VOCAB // 32) and token in allowed(bitmask[0])
        manager.accept("r", [token])
    assert allowed(manager.fill_bitmask([sched("r")])[0]) == {EOS}  # complete: only the end


def test_unconstrained_rows_are_all_ones_and_none_without_constraints(manager):
    assert manager.fill_bitmask([sched("x"), sched("y")]) is None
    manager.add_request("r", params(choice=["yes", "no"]))
    wait_ready(manager, "r")
    bitmask = manager.fill_bitmask([sched("x"), sched("r"), sched("skip", sample=False)])
    assert bitmask.shape[0] == 2 and (bitmask[0] == -1).all() and len(allowed(bitmask[1])) < 10


def test_draft_rows_use_the_advanced_matcher_and_roll_back(manager, tokenizer):
    manager.add_request("r", params(regex="abc[0-9]+"))
    wait_ready(manager, "r")
    drafts = tokenizer.encode("abc12", add_special_tokens=False)
    bitmask = manager.fill_bitmask([sched("r", drafts)])
    assert bitmask.shape[0] == len(drafts) + 1
    for j, token in enumerate(drafts):
        assert token in allowed(bitmask[j])
    # Rolled back: the first row again equals a fresh fill without drafts.
    np.testing.assert_array_equal(manager.fill_bitmask([sched("r")])[0], bitmask[0])


def test_cache_and_off_thread_compile(manager):
    threads: set[str] = set()
    original = manager._compile
    manager._compile = lambda spec: (threads.add(threading.current_thread().name), original(spec))[1]
    manager.add_request("a", params(json=SCHEMA))
    manager.add_request("b", params(json=json.dumps(SCHEMA)))  # the same grammar, as a string
    wait_ready(manager, "a")
    wait_ready(manager, "b")
    assert len(threads) == 1 and threads.pop().startswith("grammar")
    assert manager.requests["a"].grammar is manager.requests["b"].grammar


def test_allowed_token_ids_and_bad_words(manager, tokenizer):
    manager.add_request("a", SamplingParams(allowed_token_ids=[7, 40, 31, 32]))
    assert allowed(manager.fill_bitmask([sched("a")])[0]) == {7, 31, 32, 40}
    word = tokenizer.encode(" Paris France", add_special_tokens=False)
    manager.add_request("b", SamplingParams(bad_words=["Paris France"]))
    assert word[0] not in allowed(manager.fill_bitmask([sched("b")])[0]) or len(word) > 1
    manager.accept("b", word[:-1])
    row = manager.fill_bitmask([sched("b")])[0]
    assert word[-1] not in allowed(row) and len(allowed(row)) == VOCAB - 1


@pytest.mark.parametrize("so,needle", [(dict(regex="(a"), "unclosed group"), (dict(json={"type": "foo"}), "foo"),
                                       (dict(grammar="start: x"), "unknown name"), (dict(json="{"), "not valid JSON")])
def test_invalid_specs_name_the_problem(so, needle):
    with pytest.raises(ValueError, match="response_format") as info:
        validate_structured_outputs(StructuredOutputsParams(**so), "response_format")
    assert needle in str(info.value)


def test_gbnf_grammar_and_choice(manager, tokenizer):
    validate_structured_outputs(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    manager.add_request("g", params(grammar='root ::= "ab" [0-9]'))
    wait_ready(manager, "g")
    manager.accept("g", tokenizer.encode("ab", add_special_tokens=False))
    assert {tokenizer.decode([t]) for t in allowed(manager.fill_bitmask([sched("g")])[0])} == set("0123456789")


def test_scheduler_waits_for_the_grammar_not_the_batch(manager):
    gate = threading.Event()
    original = manager._compile
    manager._compile = lambda spec: (gate.wait(30), original(spec))[1]
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_model_len=64),
                  manager)
    s.add_request(Request("c", [1, 2, 3], params(json=SCHEMA), 0.0))
    s.add_request(Request("p", [4, 5, 6], SamplingParams(), 1.0))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["p"] and [r.request_id for r in s.waiting] == ["c"]
    gate.set()
    wait_ready(manager, "c")
    assert [r.request_id for r in s.schedule().scheduled] == ["p", "c"]  # p decodes, c is admitted
    s.abort_requests(["c"])
    assert "c" not in manager.requests


def test_reference_unpacking_matches_llguidance(manager):
    """Our bit order is llguidance's: its numpy reference masks the same tokens."""
    manager.add_request("r", params(choice=["yes", "no"]))
    wait_ready(manager, "r")
    bitmask = manager.fill_bitmask([sched("r")])
    logits = np.zeros((1, VOCAB), np.float32)
    llnp.apply_token_bitmask_inplace(logits, bitmask)
    assert set(np.flatnonzero(np.isfinite(logits[0])).tolist()) == allowed(bitmask[0])


# ---- JSON schemas as vLLM's default backend reads them (xgrammar, strict mode) -------------------------
# The expectations are xgrammar's documented strict mode ("will not allow properties and items that
# is not specified in the schema ... equivalent to setting unevaluatedProperties and unevaluatedItems
# to false"), checked against `jsonschema` so each case shows where the grammar is stricter than JSON
# Schema, and vLLM's documented whitespace (free by default, xgrammar's `[ \n\t]*`;
# disable_any_whitespace: "compact without any whitespace").
def city_schema(**extra: object) -> dict:
    from pydantic import BaseModel

    class City(BaseModel):  # instructor's JSON_SCHEMA mode sends this schema (no additionalProperties)
        name: str
        country: str
        population_millions: float

    return {**City.model_json_schema(), **extra}


PARIS = '{"name":"Paris","country":"France","population_millions":2.1'
ITEM = {"type": "object", "properties": {"x": {"type": "integer"}}}
NESTED = {"$defs": {"P": ITEM}, "type": "object",
          "properties": {"p": {"$ref": "#/$defs/P"}, "l": {"type": "array", "items": {"$ref": "#/$defs/P"}}}}
PAIR = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
STRICT_CASES = [  # (schema, text, the grammar accepts it)
    (city_schema(), PARIS + "}", True),
    (city_schema(), PARIS + ',"description":"A city"}', False),  # the key instructor's City came back with
    (city_schema(additionalProperties=True), PARIS + ',"description":"A city"}', True),
    (city_schema(additionalProperties={"type": "string"}), PARIS + ',"description":"A city"}', True),
    (city_schema(additionalProperties={"type": "string"}), PARIS + ',"rank":1}', False),
    (NESTED, '{"p":{"x":1},"l":[{"x":2}]}', True),
    (NESTED, '{"p":{"x":1,"y":2}}', False),  # under a $ref
    (NESTED, '{"l":[{"x":2,"y":3}]}', False),  # in an array's items
    (PAIR, '[1,"a"]', True),
    (PAIR, '[1,"a",2]', False),  # nothing beyond prefixItems
    ({**PAIR, "items": {"type": "integer"}}, '[1,"a",2]', True),
    ({"type": "array"}, "[]", True),
    ({"type": "array"}, "[1]", False),
    ({"type": "object"}, "{}", True),
    ({"type": "object"}, '{"a":1}', False),
    ({"type": "object", "additionalProperties": True}, '{"a":{"b":[1]}}', True),
]


def accepts(manager: StructuredOutputManager, so: StructuredOutputsParams, text: str) -> bool:
    matcher = manager.compile(so).result(timeout=60).deep_copy()
    tokens = manager.ll_tokenizer().tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("schema,text,expected", STRICT_CASES)
def test_json_schema_forbids_what_it_does_not_name(manager, schema, text, expected):
    if expected:
        jsonschema.validate(json.loads(text), schema)
    assert accepts(manager, StructuredOutputsParams(json=schema), text) is expected
    if not expected and "A city" in text:  # JSON Schema itself allows the extra key: the grammar is stricter
        jsonschema.validate(json.loads(text), city_schema())


def test_json_object_and_whitespace_as_xgrammar(manager):
    loose = '{\n  "name": "Paris",\n\t"country": "France",\n  "population_millions": 2.1\n}'
    assert accepts(manager, StructuredOutputsParams(json=city_schema()), loose)  # vLLM's default: free whitespace
    assert not accepts(manager, StructuredOutputsParams(json=city_schema()), PARIS.replace(",", ",\r") + "}")
    compact = StructuredOutputsParams(json=city_schema(), disable_any_whitespace=True)
    assert accepts(manager, compact, PARIS + "}")
    assert not accepts(manager, compact, '{"name": "Paris", "country": "France", "population_millions": 2.1}')
    assert not accepts(manager, compact, loose)
    assert accepts(manager, StructuredOutputsParams(json_object=True), '{"a": {"b": [1, 2]}, "c": null}')
    assert StructuredOutputsParams(json={}).disable_any_whitespace is False  # vLLM's default
