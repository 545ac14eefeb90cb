"""Tool calling: the grammar a forced `tool_choice` generates under, and vLLM-named parsers of the
model's own call format for `tool_choice: "auto"`.

    tool_choice "none"      tools are rendered by the chat template, nothing is parsed
    a named function        the output IS the arguments: JSON under that function's parameters
    "required"              a JSON array (one item unless parallel_tool_calls) of
                            {"name": one of the tools, "parameters": its schema}, vLLM's shape
    "auto"                  free text; --tool-call-parser reads calls out of it:
                              hermes       <tool_call>{"name", "arguments"}</tool_call> (Qwen, Hermes)
                              llama3_json  {"name", "parameters"} objects, `;`-separated (Llama 3.x)
                              mistral      [TOOL_CALLS] [{"name", "arguments"}, ...]
A response with calls has finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from jaxserve.entrypoints.openai.structured import NamedToolChoice

TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
# What the model's text may make json.loads raise: bad JSON, or nesting deeper than the recursion limit.
_BAD_JSON = (json.JSONDecodeError, RecursionError)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _params_schema(parameters: dict[str, object] | None) -> dict[str, object]:
    return parameters if parameters else {"type": "object", "properties": {}}


def forced_tool_schema(req: ChatCompletionRequest) -> dict[str, object] | None:
    """The JSON schema a named or `required` tool_choice generates under; None otherwise."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    tools = {t.function.name: t.function for t in req.tools or []}
    if not tools:
        raise ValueError("tool_choice: requires tools")
    if isinstance(choice, NamedToolChoice):
        fn = tools.get(choice.function.name)
        if fn is None:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not in tools")
        return _params_schema(fn.parameters)
    items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _params_schema(fn.parameters)},
              "required": ["name", "parameters"], "additionalProperties": False} for name, fn in tools.items()]
    schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def new_call(name: str, arguments: object) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=args))


def forced_calls(req: ChatCompletionRequest, text: str) -> list[ToolCall]:
    """The calls in a forced tool_choice's output (valid by the grammar unless cut by max_tokens)."""
    if isinstance(req.tool_choice, NamedToolChoice):
        return [new_call(req.tool_choice.function.name, text)]
    try:
        items = json.loads(text)
    except _BAD_JSON:
        return []  # cut short by max_tokens: finish_reason "length" tells the client
    return [new_call(str(item["name"]), item.get("parameters", {})) for item in items
            if isinstance(item, dict) and "name" in item]


def parse_auto(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content left for the user, tool calls) from free text in `parser`'s format."""
    if parser == "hermes":
        calls = [_call(m) for m in _HERMES.findall(text)]
        content = text[:text.find("<tool_call>")] if "<tool_call>" in text else text
    elif parser == "mistral":
        head, sep, tail = text.partition("[TOOL_CALLS]")
        calls = [_call(json.dumps(c)) for c in _loads(tail.strip(), list)] if sep else []
        content = head
    elif parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>")
        calls = [_call(part) for part in body.split(";")] if body.startswith("{") else []
        content = text if not calls or None in calls else ""
    else:
        raise ValueError(f"tool_call_parser: unknown parser {parser!r}; use one of {TOOL_PARSERS}")
    found = [c for c in calls if c is not None]
    if len(found) != len(calls):
        return text, []  # not a well-formed call after all: the text stays content
    return (content.strip() or None), found


def _loads(text: str, kind: type) -> list:
    try:
        value = json.loads(text)
    except _BAD_JSON:
        return []
    return value if isinstance(value, kind) else [value]


def _call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except _BAD_JSON:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return new_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Qwen3's `<think>...</think>`: (reasoning, content). While the think block is still open
    (streaming), everything after `<think>` is reasoning; text without one is all content."""
    if "</think>" in text:
        reasoning, _, content = text.partition("</think>")
        return reasoning.replace("<think>", "", 1).strip("\n") or None, content.lstrip("\n")
    stripped = text.lstrip()
    if stripped.startswith("<think>"):  # still open: hold back a partial "</think>" and trailing newlines
        reasoning = stripped.removeprefix("<think>").lstrip("\n")
        for k in range(min(len(reasoning), len("</think>") - 1), 0, -1):
            if "</think>".startswith(reasoning[-k:]):
                reasoning = reasoning[:-k]
                break
        return reasoning.rstrip("\n"), ""
    if "<think>".startswith(stripped) and stripped:
        return None, ""  # a partial tag: hold it back
    return None, text
