"""HTTP plumbing shared by the generation app (api_server.py) and the pooling app
(serving_pooling.py): the API-key middleware, the bounded JSON body reader and the endpoint
wrapper that turns every failure into an OpenAI-shaped error."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.engine.exceptions import EngineDeadError, EngineSleepingError, RequestFailedError
from jaxserve.entrypoints.openai.errors import (OpenAIError, from_server_fault, from_validation_error,
                                               from_value_error)

logger = logging.getLogger("jaxserve.api_server")
M = TypeVar("M", bound=BaseModel)


class ApiKeyMiddleware:
    """With --api-key, every route needs `Authorization: Bearer KEY`, compared in constant time; only
    the exact paths /health and /metrics stay open (/metrics too needs it with `protect_metrics`).
    The path is the one the router matches (decoded, not normalised), so `//v1/models`,
    `/v1/../v1/models`, `/v1/%6dodels` or a trailing slash all need the key as well."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = ("/health",) if protect_metrics else ("/health", "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open:
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
        except (EngineDeadError, RequestFailedError, EngineSleepingError) as exc:  # logged where they happened
            return from_server_fault(exc).response()
        except Exception as exc:  # noqa: BLE001  (the server must stay up)
            logger.exception("internal error on %s %s", request.method, request.url.path)
            return from_server_fault(exc).response()

    return wrapped
