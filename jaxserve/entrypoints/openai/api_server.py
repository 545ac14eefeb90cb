"""The OpenAI-compatible HTTP server: `build_app(engine)` for any engine, `run_server(config)` for the CLI.

    request -> ApiKeyMiddleware (/v1 only) -> route -> _endpoint (OpenAIError -> JSON, anything else -> 500)
            -> read_json (size limit, strict pydantic) -> ServingCompletion / ServingChat -> engine

Drop-in for vLLM: `python -m jaxserve.entrypoints.openai.api_server --model MODEL [flags]`.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TypeVar

import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import jaxserve
from jaxserve.engine.args import EngineArgs
from jaxserve.entrypoints import cli_args
from jaxserve.entrypoints.openai import protocol as p
from jaxserve.entrypoints.openai.engine_client import EngineClient
from jaxserve.entrypoints.openai.errors import OpenAIError, from_validation_error, from_value_error
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.openapi import build_openapi
from jaxserve.entrypoints.openai.serving_chat import ServingChat, load_chat_template
from jaxserve.entrypoints.openai.serving_completion import ServingCompletion
from jaxserve.entrypoints.openai.serving_lora import lora_routes, model_cards, register_lora_modules

logger = logging.getLogger("jaxserve.api_server")
M = TypeVar("M", bound=BaseModel)
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class ApiKeyMiddleware:
    """With --api-key, every /v1 route needs `Authorization: Bearer KEY` (health and metrics stay open)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):
                error = OpenAIError("Incorrect or missing API key; pass `Authorization: Bearer KEY`.",
                                    status=401, code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: Request, model: type[M], limit: int) -> M:
    """The body parsed into `model`, or a 400/413 OpenAIError."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(f"Request body exceeds {limit} bytes", status=413, code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(f"Request body exceeds {limit} bytes", status=413, code="request_too_large")
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


Handler = Callable[[Request], Awaitable[Response]]


def _endpoint(handler: Handler) -> Handler:
    """One bad request never takes the server down: known errors are 4xx, the rest a logged 500.
    A ValueError is bad input by this project's convention (its message names the field): a 400."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except OpenAIError as exc:
            return exc.response()
        except ValueError as exc:
            return from_value_error(exc).response()
        except Exception as exc:  # noqa: BLE001  (the server must stay up)
            logger.exception("internal error on %s %s", request.method, request.url.path)
            return OpenAIError(f"Internal server error: {exc!r}", status=500).response()

    return wrapped


def build_app(engine: EngineClient, *, api_key: str | None = None, chat_template: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, trust_request_chat_template: bool = False,
              tool_parser: str | None = None, reasoning_parser: str | None = None) -> Starlette:
    """The ASGI app serving `engine`; each app has its own metrics registry. `tool_parser`: parse
    `tool_choice: auto` calls from the model's text (--enable-auto-tool-choice --tool-call-parser)."""
    metrics = ServerMetrics(engine)
    completions = ServingCompletion(engine, metrics)
    chat = ServingChat(engine, metrics, load_chat_template(chat_template),
                       trust_request_chat_template=trust_request_chat_template, tool_parser=tool_parser,
                       reasoning_parser=reasoning_parser)
    openapi = build_openapi(jaxserve.__version__)

    async def create_completion(request: Request) -> Response:
        return await completions.create(await read_json(request, p.CompletionRequest, max_body_bytes), request)

    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await read_json(request, p.ChatCompletionRequest, max_body_bytes), request)

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
        # The engine may expose `errored` (its loop thread died); then load balancers should drain us.
        if getattr(engine, "errored", False):
            return OpenAIError("The engine has stopped", status=503).response()
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse(p.VersionResponse(version=jaxserve.__version__).model_dump())

    async def metrics_endpoint(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    async def openapi_endpoint(request: Request) -> Response:
        return JSONResponse(openapi)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return OpenAIError(message, status=exc.status_code, code=code).response()

    routes = [
        Route("/v1/completions", _endpoint(create_completion), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(create_chat_completion), methods=["POST"]),
        Route("/v1/models", _endpoint(list_models), methods=["GET"]),
        Route("/tokenize", _endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(detokenize), methods=["POST"]),
        Route("/health", _endpoint(health), methods=["GET"]),
        Route("/version", _endpoint(version), methods=["GET"]),
        Route("/metrics", _endpoint(metrics_endpoint), methods=["GET"]),
        Route("/openapi.json", _endpoint(openapi_endpoint), methods=["GET"]),
    ] + lora_routes(engine, read_json, _endpoint, max_body_bytes)
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.state.engine = engine
    app.state.metrics = metrics
    return app


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown (exit status 143); we want 0."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM:
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def log_startup(engine: EngineClient, args: EngineArgs, seconds: float) -> None:
    """What was sized at start-up. The engine may add its own report via `startup_report() -> str`."""
    stats = engine.get_stats()
    tokens = stats.num_gpu_blocks * engine.block_size
    logger.info("model %s: max_model_len %d, %d KV blocks of %d tokens (%d tokens): max concurrency %.2f "
                "requests at max_model_len; loaded and warmed up in %.1f s", engine.model_name,
                engine.max_model_len, stats.num_gpu_blocks, engine.block_size, tokens,
                tokens / max(engine.max_model_len, 1), seconds)
    report = getattr(engine, "startup_report", None)
    if callable(report):
        logger.info("%s", report())


def serve_app(app: Starlette, server: cli_args.ServerArgs) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get `timeout_graceful_shutdown` seconds to finish."""
    _Server(uvicorn.Config(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level,
                           timeout_graceful_shutdown=server.timeout_graceful_shutdown)).run()


def run_server(config: cli_args.ServeConfig) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, shut the engine down; 0 after a clean stop."""
    from jaxserve.worker import multihost
    from jaxserve.engine.async_llm import AsyncLLM  # JAX and the model load only when serving

    start = time.monotonic()
    if multihost.is_enabled(config.engine):  # --num-hosts: rank 0 serves and schedules, the others follow
        multihost.initialize(config.engine)
        if not multihost.is_leader():
            return multihost.run_worker(config.engine)
        engine = AsyncLLM(multihost.leader_engine(config.engine))
    else:
        engine = AsyncLLM.from_engine_args(config.engine)
    log_startup(engine, config.engine, time.monotonic() - start)
    try:
        server = config.server
        register_lora_modules(engine, server.lora_modules)
        app = build_app(engine, api_key=server.api_key, chat_template=config.engine.chat_template,
                        max_body_bytes=server.max_request_body_bytes,
                        trust_request_chat_template=server.trust_request_chat_template,
                        tool_parser=server.tool_call_parser if server.enable_auto_tool_choice else None,
                        reasoning_parser=server.reasoning_parser)
        serve_app(app, config.server)
    finally:
        engine.shutdown()
        if isinstance(engine, AsyncLLM):
            multihost.stop_workers(engine.engine)
    return 0


def run_from_namespace(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Shared by `jaxserve serve` and `python -m ...api_server`: flags -> ServeConfig -> run_server."""
    try:
        config = cli_args.resolve(ns)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_server(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.entrypoints.openai.api_server",
                                     description="OpenAI-compatible server (vLLM drop-in flags).")
    cli_args.add_serve_args(parser, positional_model=False)
    return run_from_namespace(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
