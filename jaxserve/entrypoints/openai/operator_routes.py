"""What every jaxserve server has, whatever its runner (generate or pooling): the routes /v1/models,
/tokenize, /detokenize, /health, /version, /metrics (vLLM's shapes and metric names), and the app
around its own routes (`server_app`: the OpenAI-shaped 404/405, the API key, the lifecycle)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.entrypoints.openai import lifecycle
from jaxserve.entrypoints.openai import protocol as p
from jaxserve.entrypoints.openai.engine_client import EngineClient
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.http import ApiKeyMiddleware, _endpoint, read_json
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


def server_app(routes: list[Route], engine: EngineClient, chat: ServingChat, metrics: ServerMetrics,
               state: lifecycle.ServerState, *, max_body_bytes: int, api_key: str | None, protect_metrics: bool,
               max_header_bytes: int) -> Starlette:
    """A server's own `routes` plus the operator routes, unknown paths and methods answered as OpenAI
    errors, behind ApiKeyMiddleware (with `api_key`) and LifecycleMiddleware (outermost)."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return OpenAIError(message, status=exc.status_code, code=code).response()

    routes = routes + operator_routes(engine, chat, metrics, state, max_body_bytes)
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, protect_metrics=protect_metrics)
    app.add_middleware(lifecycle.LifecycleMiddleware, engine=engine, state=state,
                       max_header_bytes=max_header_bytes)  # outermost
    app.state.engine = engine
    app.state.lifecycle = state
    app.state.metrics = metrics
    return app
