"""Tool-call parsers, the forced tool_choice schema, the qwen3 reasoning split (whole and streamed),
and the request models' mapping to SamplingParams. No model: pure functions on text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve.engine.outputs import CompletionOutput
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.entrypoints.openai.serving_chat import ServingChat, _Sent
from jaxserve.entrypoints.openai.tool_calls import forced_calls, forced_tool_schema, parse_auto, split_reasoning

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "now"}}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Sure.", [("add", {"a": 1, "b": 2})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
               '<tool_call>{"name": "now", "arguments": {}}</tool_call>', None,
     [("add", {"a": 1, "b": 2}), ("now", {})]),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 3, "b": 4}}', None, [("add", {"a": 3, "b": 4})]),
    ("llama3_json", '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "add", "parameters": {"a": 1, "b": 1}}',
     None, [("now", {}), ("add", {"a": 1, "b": 1})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 5, "b": 6}}]', None, [("add", {"a": 5, "b": 6})]),
    ("mistral", "plain answer", "plain answer", []),
])
def test_auto_parsers(parser: str, text: str, content: str | None, calls: list) -> None:
    got_content, got = parse_auto(parser, text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


def test_forced_schemas() -> None:
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert forced_tool_schema(named) == TOOLS[0]["function"]["parameters"]
    assert [c.function.name for c in forced_calls(named, '{"a":1,"b":2}')] == ["add"]
    required = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = forced_tool_schema(required)
    good = [{"name": "add", "parameters": {"a": 1, "b": 2}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good * 2, schema)  # parallel_tool_calls=False: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], schema)
    assert [c.function.name for c in forced_calls(required, json.dumps(good))] == ["add"]
    assert forced_calls(required, '[{"name": "ad') == []  # cut by max_tokens
    assert forced_tool_schema(chat(tools=TOOLS, tool_choice="auto")) is None
    with pytest.raises(ValueError, match="tool_choice"):
        forced_tool_schema(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}))


@pytest.mark.parametrize("text,reasoning,content", [
    ("<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("Let me see.</think>Paris.", "Let me see.", "Paris."),  # the template opened <think> in the prompt
    ("<think>still thinking", "still thinking", ""),
    ("<thi", None, ""),
    ("Paris.", None, "Paris."),
])
def test_qwen3_reasoning_split(text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text) == (reasoning, content)


def test_streamed_reasoning_deltas_add_up() -> None:
    serving = ServingChat.__new__(ServingChat)
    serving.reasoning_parser, serving.tool_parser = "qwen3", None
    req = chat()
    full = "<think>\nStep one. Step two.\n</think>\n\nThe answer is 4."
    sent, reasoning, content = _Sent(), "", ""
    for end in range(1, len(full) + 1):
        out = CompletionOutput(index=0, text=full[:end], token_ids=list(range(end)),
                               finish_reason="stop" if end == len(full) else None)
        delta, finish = serving._delta(req, out, sent)
        reasoning += delta.reasoning or ""
        content += delta.content or ""
    assert (reasoning, content, finish) == ("Step one. Step two.", "The answer is 4.", "stop")


def test_to_sampling_params_one_mapping() -> None:
    params = CompletionRequest.model_validate({"prompt": "x", "temperature": 0.5, "allowed_token_ids": [1, 2],
                                               "bad_words": ["no"], "structured_outputs": {"choice": ["a", "b"]}})
    sp = params.to_sampling_params(8)
    assert (sp.temperature, sp.max_tokens, sp.allowed_token_ids, sp.bad_words) == (0.5, 8, [1, 2], ["no"])
    assert sp.structured_outputs.choice == ["a", "b"]
    c = chat(max_completion_tokens=4, response_format={"type": "json_object"}, top_logprobs=2, logprobs=True)
    assert c.to_sampling_params(4, logprobs=2).structured_outputs.json_object
    with pytest.raises(ValueError, match="^top_logprobs "):  # SamplingParams' name, the request's field
        c.to_sampling_params(4, logprobs=99)
    with pytest.raises(ValueError, match="^guided_regex: only one of"):  # two constraints: the second is named
        chat(structured_outputs={"regex": "a"}, guided_regex="b").structured_params()
