"""Request-side models of structured outputs and tools, and their mapping to a grammar.

Four ways to ask for constrained output, one result (`StructuredOutputsParams`):
    response_format       OpenAI's {"type": "json_object"} / {"type": "json_schema", "json_schema":
                          {"name", "schema", "strict"}} (what the SDK's `.parse()` sends)
    structured_outputs    vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_*              vLLM's older names (guided_json, guided_regex, guided_choice, guided_grammar)
    tool_choice           "required" or a named function: the arguments are generated under the
                          tools' parameter schemas (tool_calls.py builds that schema)
Giving two of them is a 400 naming the second; a schema, regex or grammar llguidance refuses is
a 400 naming the field and the problem (checked here, before the request reaches the engine).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.core.structured_output import validate_structured_outputs


class _Part(BaseModel):
    # Forgiving like the requests (unknown keys kept); pydantic is strict about the declared ones.
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True, allow_inf_nan=False)


class JsonSchemaFormat(_Part):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Part):
    json_: dict[str, object] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class FunctionDefinition(_Part):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ChatTool(_Part):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredFields(_Part):
    """The fields chat and completions share; mixed into their request models."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, object] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_params(self, tool_schema: dict[str, object] | None = None) -> StructuredOutputsParams | None:
        """The one constraint this request asks for (validated), or None. `tool_schema`: the schema
        tool_choice demands (chat), which counts as one of the ways."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append(("response_format", _from_response_format(self.response_format)))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object,
                disable_any_whitespace=so.disable_any_whitespace)))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                given.append((name, StructuredOutputsParams(**{name.removeprefix("guided_"): value})))
        if tool_schema is not None:
            given.append(("tool_choice", StructuredOutputsParams(json=tool_schema)))
        if len(given) > 1:
            raise ValueError(f"{given[1][0]}: only one of response_format, structured_outputs, guided_* and a "
                             f"forced tool_choice may constrain the output (also given: {given[0][0]})")
        if not given:
            return None
        field_name, params = given[0]
        validate_structured_outputs(params, field_name)
        return params


def _from_response_format(rf: ResponseFormat) -> StructuredOutputsParams:
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise ValueError("response_format: type json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=rf.json_schema.json_schema)
