"""vLLM's development routes, for a trainer in another process driving the server between RL steps.

    POST /sleep?level=1|2&mode=abort|wait|keep  free the KV pool (level 1: weights to host memory;
                                                level 2: weights dropped); 200, empty body
    POST /wake_up[?tags=weights&tags=kv_cache]  restore them (no tags: everything); 200, empty body
    GET  /is_sleeping                           {"is_sleeping": bool}
    POST /pause?mode=abort|wait|keep            stop scheduling ({"status": "paused"}); requests
                                                that arrive meanwhile wait for /resume
    POST /resume                                {"status": "resumed"}
    GET  /is_paused                             {"is_paused": bool}
    POST /update_weights_from_disk              {"model_path": DIR, "version": V} (SGLang's): new weights
                                                from an HF safetensors dir or a convert checkpoint
    POST /reset_prefix_cache                    forget the prefix cache; 200, empty body

Registered only with `--enable-sleep-mode` or `VLLM_SERVER_DEV_MODE=1` (these routes can drop the
served weights), and behind `--api-key` like every route (server_app wraps them). A bad query value
is a 400 naming it.
"""

from __future__ import annotations

import os

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.http import Handler, _endpoint, read_json

DEV_MODE_ENV = ("VLLM_SERVER_DEV_MODE", "JAXSERVE_SERVER_DEV_MODE")
PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")


def dev_mode_enabled(engine: object) -> bool:
    """`VLLM_SERVER_DEV_MODE=1` (or JAXSERVE_SERVER_DEV_MODE), or the engine built with --enable-sleep-mode."""
    if any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in DEV_MODE_ENV):
        return True
    args = getattr(getattr(engine, "core_engine", None), "args", None)
    return bool(getattr(args, "enable_sleep_mode", False))


def query_choice(request: Request, name: str, choices: tuple[str, ...], default: str) -> str:
    value = request.query_params.get(name, default)
    if value not in choices:
        raise OpenAIError(f"{name}: must be one of {', '.join(choices)}, got {value!r}", param=name)
    return value


def query_bool(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise OpenAIError(f"{name}: must be true or false, got {value!r}", param=name)
    return value.lower() in ("true", "1")


def sleep_routes(engine) -> list[Route]:
    """/sleep, /wake_up, /is_sleeping (vLLM's names, query parameters and answers)."""

    async def sleep(request: Request) -> Response:
        level = query_choice(request, "level", ("1", "2"), "1")
        await engine.sleep(int(level), mode=query_choice(request, "mode", PAUSE_MODES, "abort"))
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags")
        bad = next((t for t in tags if t not in WAKE_TAGS), None)
        if bad is not None:
            raise OpenAIError(f"tags: must be among {', '.join(WAKE_TAGS)}, got {bad!r}", param="tags")
        await engine.wake_up(tags or None)
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    return [Route("/sleep", _endpoint(sleep), methods=["POST"]),
            Route("/wake_up", _endpoint(wake_up), methods=["POST"]),
            Route("/is_sleeping", _endpoint(is_sleeping), methods=["GET"])]


def pause_routes(engine) -> list[Route]:
    """/pause, /resume, /is_paused. vLLM's deprecated `wait_for_inflight_requests=true` means mode=wait;
    `clear_cache` (default true) empties the prefix cache once the in-flight requests are gone."""

    async def pause(request: Request) -> Response:
        mode = query_choice(request, "mode", PAUSE_MODES, "abort")
        if query_bool(request, "wait_for_inflight_requests", False):
            mode = "wait"
        await engine.pause_generation(mode=mode, clear_cache=query_bool(request, "clear_cache", True))
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        await engine.resume_generation()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": await engine.is_paused()})

    return [Route("/pause", _endpoint(pause), methods=["POST"]),
            Route("/resume", _endpoint(resume), methods=["POST"]),
            Route("/is_paused", _endpoint(is_paused), methods=["GET"])]


class UpdateWeightsFromDisk(BaseModel):
    """SGLang's /update_weights_from_disk body: `version` (SGLang: `weight_version`) is kept as the
    engine's weights_version."""
    model_path: str
    version: str | int | None = None
    weight_version: str | int | None = None


def weight_routes(engine, max_body_bytes: int) -> list[Route]:
    """POST /update_weights_from_disk {"model_path": DIR, "version": V} (SGLang's name: an HF safetensors
    directory or a `jaxserve convert` checkpoint of the served model; anything else is a 400 saying why,
    the old weights kept) and POST /reset_prefix_cache (vLLM's). Both run on the engine thread between
    steps (engine/weight_sync.py)."""

    async def update_weights_from_disk(request: Request) -> Response:
        body = await read_json(request, UpdateWeightsFromDisk, max_body_bytes)
        version = body.version if body.version is not None else body.weight_version
        await engine.update_weights_from_disk(body.model_path, version=version)
        return JSONResponse({"success": True, "message": f"weights updated from {body.model_path}",
                             "version": version})

    async def reset_prefix_cache(request: Request) -> Response:
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    return [Route("/update_weights_from_disk", _endpoint(update_weights_from_disk), methods=["POST"]),
            Route("/reset_prefix_cache", _endpoint(reset_prefix_cache), methods=["POST"])]


def dev_routes(engine, max_body_bytes: int) -> list[Route]:
    """Every dev route, or none unless dev_mode_enabled(engine). `max_body_bytes` bounds JSON bodies."""
    if not dev_mode_enabled(engine):
        return []
    routes = sleep_routes(engine) + pause_routes(engine) + weight_routes(engine, max_body_bytes)
    return routes


__all__ = ["DEV_MODE_ENV", "Handler", "dev_mode_enabled", "dev_routes", "query_bool", "query_choice"]
