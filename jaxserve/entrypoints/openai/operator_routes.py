"""The routes every jaxserve server has, whatever its runner (generate or pooling): /v1/models,
/tokenize, /detokenize, /health, /version, /metrics (vLLM's shapes and metric names)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.entrypoints.openai import lifecycle
from jaxserve.entrypoints.openai import protocol as p
from jaxserve.entrypoints.openai.engine_client import EngineClient
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.http import _endpoint, read_json
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.serving_chat import ServingChat
from jaxserve.entrypoints.openai.serving_lora import model_cards


def operator_routes(engine: EngineClient, chat: ServingChat, metrics: ServerMetrics, state: lifecycle.ServerState,
                    max_body_bytes: int) -> list[Route]:
    """`chat` tokenizes (a prompt, or messages through the chat template); `metrics` is the app's registry."""

    async def list_models(request: Request) -> Response:
        return JSONResponse(p.ModelList(data=model_cards(engine)).model_dump())

    async def tokenize(request: Request) -> Response:
        req = await read_json(request, p.TokenizeRequest, max_body_bytes)
        chat.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("Give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = chat.render(req.messages, add_generation_prompt=req.add_generation_prompt)
        else:
            ids = chat.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        body = p.TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)
        return JSONResponse(body.model_dump())

    async def detokenize(request: Request) -> Response:
        req = await read_json(request, p.DetokenizeRequest, max_body_bytes)
        chat.check_model(req.model)
        chat.check_token_ids(req.tokens, "tokens")
        return JSONResponse(p.DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens)).model_dump())

    async def health(request: Request) -> Response:
        # 503 while warming up, shutting down, or after the engine died: load balancers drain us.
        refusal = lifecycle.unavailable(engine, state)
        return Response(status_code=200) if refusal is None else refusal.response()

    async def version(request: Request) -> Response:
        return JSONResponse(p.VersionResponse(version=jaxserve.__version__).model_dump())

    async def metrics_endpoint(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    return [
        Route("/v1/models", _endpoint(list_models), methods=["GET"]),
        Route("/tokenize", _endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(detokenize), methods=["POST"]),
        Route("/health", _endpoint(health), methods=["GET"]),
        Route("/version", _endpoint(version), methods=["GET"]),
        Route("/metrics", _endpoint(metrics_endpoint), methods=["GET"]),
    ]
