"""GET /openapi.json, generated from the pydantic models so the schema cannot drift from validation."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from jaxserve.entrypoints.openai import protocol as p

_REF = "#/components/schemas/{model}"

# (method, path, request model, response model, streams SSE)
_ROUTES: list[tuple[str, str, type[BaseModel] | None, type[BaseModel] | None, bool]] = [
    ("post", "/v1/completions", p.CompletionRequest, p.CompletionResponse, True),
    ("post", "/v1/chat/completions", p.ChatCompletionRequest, p.ChatCompletionResponse, True),
    ("get", "/v1/models", None, p.ModelList, False),
    ("post", "/tokenize", p.TokenizeRequest, p.TokenizeResponse, False),
    ("post", "/detokenize", p.DetokenizeRequest, p.DetokenizeResponse, False),
    ("get", "/version", None, p.VersionResponse, False),
    ("get", "/health", None, None, False),
    ("get", "/metrics", None, None, False),
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def build_openapi(version: str) -> dict[str, object]:
    inputs: list[tuple[type[BaseModel], JsonSchemaMode]] = []
    for _, _, request, response, _ in _ROUTES:
        if request is not None:
            inputs.append((request, "validation"))
        if response is not None:
            inputs.append((response, "serialization"))
    inputs.append((p.ErrorResponse, "serialization"))
    inputs.append((p.ChatCompletionChunk, "serialization"))
    _, defs = models_json_schema(inputs, ref_template=_REF)
    error = {"description": "OpenAI-shaped error",
             "content": {"application/json": {"schema": _ref(p.ErrorResponse)}}}
    paths: dict[str, dict[str, object]] = {}
    for method, path, request, response, streams in _ROUTES:
        content: dict[str, object] = {}
        if response is not None:
            content["application/json"] = {"schema": _ref(response)}
        elif path == "/metrics":
            content["text/plain"] = {"schema": {"type": "string"}}
        if streams:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        operation: dict[str, object] = {
            "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
            "responses": {"200": {"description": "OK", **({"content": content} if content else {})}, "4XX": error},
        }
        if request is not None:
            operation["requestBody"] = {"required": True,
                                        "content": {"application/json": {"schema": _ref(request)}}}
        paths[path] = {method: operation}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve OpenAI-compatible API", "version": version},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }
