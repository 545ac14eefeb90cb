"""The OpenAI-compatible HTTP server: `build_app(engine)` for any engine, `run_server(config)` for the CLI.

    request -> LifecycleMiddleware (431 for huge headers; 503 while starting, draining or dead)
            -> ApiKeyMiddleware -> route -> _endpoint (OpenAIError -> JSON, anything else -> 500)
            -> read_json (size limit, strict pydantic) -> ServingCompletion / ServingChat -> engine

Drop-in for vLLM: `python -m jaxserve.entrypoints.openai.api_server --model MODEL [flags]`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.engine.args import EngineArgs
from jaxserve.entrypoints import cli_args
from jaxserve.entrypoints.openai import protocol as p
from jaxserve.entrypoints.openai.engine_client import EngineClient
from jaxserve.entrypoints.openai.dev_routes import dev_routes
from jaxserve.entrypoints.openai import lifecycle
from jaxserve.entrypoints.openai.http import ApiKeyMiddleware, Handler, _endpoint, read_json  # noqa: F401
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.openapi import build_openapi
from jaxserve.entrypoints.openai.operator_routes import server_app
from jaxserve.entrypoints.openai.serving_chat import ServingChat, load_chat_template
from jaxserve.entrypoints.openai.serving_completion import ServingCompletion
from jaxserve.entrypoints.openai.serving_pooling import POOLING_ROUTES, pooling_routes, wrong_runner
from jaxserve.entrypoints.openai.serving_lora import lora_routes, register_lora_modules

logger = logging.getLogger("jaxserve.api_server")
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def build_app(engine: EngineClient, *, api_key: str | None = None, chat_template: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, trust_request_chat_template: bool = False,
              tool_parser: str | None = None, reasoning_parser: str | None = None,
              state: lifecycle.ServerState | None = None, max_num_queued_reqs: int | None = None,
              protect_metrics: bool = False, max_n_sequences: int = 16384,
              max_header_bytes: int = lifecycle.DEFAULT_MAX_HEADER_BYTES) -> Starlette:
    """The ASGI app serving `engine`; each app has its own metrics registry. `tool_parser`: parse
    `tool_choice: auto` calls from the model's text (--enable-auto-tool-choice --tool-call-parser)."""
    metrics = ServerMetrics(engine)
    state = state or lifecycle.ServerState()
    completions = ServingCompletion(engine, metrics)
    chat = ServingChat(engine, metrics, load_chat_template(chat_template),
                       trust_request_chat_template=trust_request_chat_template, tool_parser=tool_parser,
                       reasoning_parser=reasoning_parser)
    for serving in (completions, chat):
        serving.max_num_queued_reqs, serving.max_n_sequences = max_num_queued_reqs, max_n_sequences
    openapi = build_openapi(jaxserve.__version__)

    async def create_completion(request: Request) -> Response:
        return await completions.create(await read_json(request, p.CompletionRequest, max_body_bytes), request)

    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await read_json(request, p.ChatCompletionRequest, max_body_bytes), request)

    async def openapi_endpoint(request: Request) -> Response:
        return JSONResponse(openapi)

    routes = [Route("/openapi.json", _endpoint(openapi_endpoint), methods=["GET"])]
    routes += lora_routes(engine, read_json, _endpoint, max_body_bytes)
    routes += dev_routes(engine, max_body_bytes)  # --enable-sleep-mode / VLLM_SERVER_DEV_MODE=1 only
    if getattr(engine, "runner_kind", "generate") == "pooling":  # embeddings, scores: serving_pooling.py
        routes += pooling_routes(engine, metrics, max_body_bytes, max_num_queued_reqs)
    else:
        routes += [Route("/v1/completions", _endpoint(create_completion), methods=["POST"]),
                   Route("/v1/chat/completions", _endpoint(create_chat_completion), methods=["POST"])]
        routes += [Route(path, _endpoint(_refuse_pooling(path)), methods=["POST"]) for path in POOLING_ROUTES]
    return server_app(routes, engine, chat, metrics, state, max_body_bytes=max_body_bytes, api_key=api_key,
                      protect_metrics=protect_metrics, max_header_bytes=max_header_bytes)


def _refuse_pooling(path: str) -> Handler:
    async def handler(request: Request) -> Response:
        raise wrong_runner("generate", path)
    return handler


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


def serve_app(app: Starlette, server: cli_args.ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM (0: in-flight requests get `shutdown_timeout` seconds, then are
    aborted) or the engine's death (1)."""
    return lifecycle.serve(app, app.state.engine, app.state.lifecycle, host=server.host, port=server.port,
                           log_level=server.uvicorn_log_level, shutdown_timeout=server.shutdown_timeout)


def app_for(engine: EngineClient, config: cli_args.ServeConfig, state: lifecycle.ServerState) -> Starlette:
    """The app with every server flag applied."""
    server = config.server
    return build_app(engine, api_key=server.api_key, chat_template=config.engine.chat_template,
                     max_body_bytes=server.max_request_body_bytes,
                     trust_request_chat_template=server.trust_request_chat_template,
                     tool_parser=server.tool_call_parser if server.enable_auto_tool_choice else None,
                     reasoning_parser=server.reasoning_parser, state=state,
                     max_num_queued_reqs=server.max_num_queued_reqs, protect_metrics=server.api_key_protects_metrics,
                     max_n_sequences=server.max_n_sequences, max_header_bytes=server.max_request_header_bytes)


def run_server(config: cli_args.ServeConfig) -> int:
    """Bind at once (503 everywhere, /health included, while the engine loads and warms up), serve
    until SIGINT/SIGTERM (0) or the engine's death (1), shut the engine down."""
    from jaxserve.engine import multihost
    from jaxserve.engine.async_llm import AsyncLLM  # JAX and the model load only when serving

    background = not multihost.is_enabled(config.engine)  # multi-host start-up stays on the main thread
    if not background:  # --num-hosts: rank 0 serves and schedules, the others follow
        multihost.initialize(config.engine)
        if not multihost.is_leader():
            return multihost.run_worker(config.engine)
    state = lifecycle.ServerState(ready=False)
    gate = lifecycle.StartupGate(state)

    def load() -> None:
        start = time.monotonic()
        try:
            engine = (AsyncLLM.from_engine_args(config.engine) if background
                      else AsyncLLM(multihost.leader_engine(config.engine)))
            register_lora_modules(engine, config.server.lora_modules)
            log_startup(engine, config.engine, time.monotonic() - start)
            gate.open(app_for(engine, config, state), engine)
        except Exception:  # noqa: BLE001  (reported, and the server exits 1)
            logger.exception("the engine failed to start")
            gate.failed = True

    if background:
        threading.Thread(target=load, name="jaxserve-load", daemon=True).start()
    else:
        load()
    server = config.server
    try:
        code = lifecycle.serve(gate, gate, state, host=server.host, port=server.port,
                               log_level=server.uvicorn_log_level, shutdown_timeout=server.shutdown_timeout)
    finally:
        engine = gate.engine
        if engine is not None:
            engine.shutdown()
            if isinstance(engine, AsyncLLM):
                multihost.stop_workers(engine.engine)
    return code


def _check_runner(config: cli_args.ServeConfig) -> None:
    """Before binding: --runner generate on a pooling model (and the like), or a flag that does not
    apply to a pooling model, is a usage error naming it, not a traceback after loading."""
    from jaxserve.engine.pooling import is_encoder, pooling_info, refuse_flags

    try:
        info = pooling_info(config.engine)
    except FileNotFoundError:
        return  # the model is missing: loading it says so
    if info is None:
        return
    refuse_flags(config.engine, is_encoder(info))
    server = config.server
    for flag, given in (("enable_auto_tool_choice", server.enable_auto_tool_choice),
                        ("reasoning_parser", server.reasoning_parser), ("lora_modules", server.lora_modules)):
        if given:
            raise ValueError(f"{flag}: does not apply to a pooling model (embeddings, scores): "
                             f"remove --{flag.replace('_', '-')}")


def run_from_namespace(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Shared by `jaxserve serve` and `python -m ...api_server`: flags -> ServeConfig -> run_server."""
    try:
        config = cli_args.resolve(ns)
        _check_runner(config)
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
