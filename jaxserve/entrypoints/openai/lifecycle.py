"""The server's life: readiness, draining on SIGTERM/SIGINT, and exiting when the engine dies.

    LifecycleMiddleware   headers past a size limit: 431; every route but /health and /metrics: 503
                          while starting, shutting down or after the engine died; counts the
                          requests in flight
    LifecycleServer       uvicorn with vLLM's shutdown: the first SIGTERM/SIGINT stops accepting,
                          in-flight requests get `shutdown_timeout` seconds, then whatever is left is
                          aborted (finish_reason "abort") and the process exits 0; a dead engine
                          ends every request with an error and exits 1 (a supervisor restarts it)

A second SIGINT exits at once (uvicorn's force exit).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.entrypoints.openai.engine_client import EngineClient
from jaxserve.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("jaxserve.api_server")
OPEN_PATHS = ("/health", "/metrics")  # answer while draining or dead: they report it
ABORT_GRACE_S = 5.0  # after aborting (or the engine's death), responses get this long to be sent
SOCKET_GRACE_S = 3.0  # uvicorn's own wait for connections once the server stops
DEFAULT_MAX_HEADER_BYTES = 64 * 1024


@dataclass
class ServerState:
    """Shared by the middleware, /health and the server loop (all on the event loop's thread)."""

    ready: bool = True  # the engine has warmed up (False while `jaxserve serve` loads it)
    draining: bool = False  # a shutdown signal arrived: no new requests
    num_in_flight: int = 0  # requests past the middleware, not yet answered


def engine_dead(engine: EngineClient) -> bool:
    return bool(getattr(engine, "errored", False))


def unavailable(engine: EngineClient, state: ServerState) -> OpenAIError | None:
    """Why the server refuses work now (a 503), or None."""
    if engine_dead(engine):
        return OpenAIError("The engine has stopped after an error; the server is restarting", status=503,
                           code="engine_dead")
    if state.draining:
        return OpenAIError("The server is shutting down", status=503, code="shutting_down")
    if not state.ready:
        return OpenAIError("The server is starting up", status=503, code="starting_up")
    return None


class LifecycleMiddleware:
    def __init__(self, app: ASGIApp, engine: EngineClient, state: ServerState,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> None:
        self.app, self.engine, self.state, self.max_header_bytes = app, engine, state, max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) for k, v in scope["headers"]) > self.max_header_bytes:
            error = OpenAIError(f"Request headers exceed {self.max_header_bytes} bytes", status=431,
                                code="request_header_fields_too_large")
            await error.response()(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        refusal = unavailable(self.engine, self.state)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        self.state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1


class StartupGate:
    """The ASGI app `jaxserve serve` binds before the engine has loaded: 503 everywhere (/health
    included) until `open(app, engine)`, then the real app. As an engine it reports `errored`
    when start-up failed, so the server exits 1."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.app: ASGIApp | None = None
        self.engine: EngineClient | None = None
        self.failed = False

    def open(self, app: ASGIApp, engine: EngineClient) -> None:
        self.app, self.engine = app, engine
        self.state.ready = True

    @property
    def errored(self) -> bool:
        return self.failed or (self.engine is not None and engine_dead(self.engine))

    def abort_all(self) -> None:
        abort_all = getattr(self.engine, "abort_all", None)
        if callable(abort_all):
            abort_all()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await unavailable(self, self.state).response()(scope, receive, send)  # type: ignore[union-attr, arg-type]


class LifecycleServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: EngineClient, state: ServerState,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.state, self.shutdown_timeout = engine, state, shutdown_timeout
        self.exit_code = 0
        self._drain_started: float | None = None
        self._aborted_at: float | None = None
        self._dead_since: float | None = None

    def _abort_all(self) -> None:
        abort_all = getattr(self.engine, "abort_all", None)
        if callable(abort_all):
            abort_all()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """(From the signal handler.) Not uvicorn's: no exit yet, and no re-raised SIGTERM (status 0)."""
        if self.state.draining and sig == signal.SIGINT:
            self.force_exit = self.should_exit = True
            return
        self.state.draining = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        now = time.monotonic()
        if engine_dead(self.engine):
            if self._dead_since is None:
                logger.error("the engine is dead (or failed to start): ending open requests, then exiting "
                             "with status 1")
                self._dead_since, self.exit_code = now, 1
                self._abort_all()  # what a surviving data-parallel replica still runs ends as "abort"
            return self.state.num_in_flight == 0 or now - self._dead_since > ABORT_GRACE_S
        if not self.state.draining:
            return False
        if self._drain_started is None:
            logger.info("shutting down: %d requests in flight, up to %.1f s to finish", self.state.num_in_flight,
                        self.shutdown_timeout)
            self._drain_started = now
        if self.state.num_in_flight == 0:
            return True
        if self._aborted_at is None and now - self._drain_started >= self.shutdown_timeout:
            logger.info("shutdown timeout: aborting %d requests", self.state.num_in_flight)
            self._abort_all()
            self._aborted_at = now
        return self._aborted_at is not None and now - self._aborted_at > ABORT_GRACE_S


def serve(app: ASGIApp, engine: EngineClient, state: ServerState, *, host: str, port: int, log_level: str,
          shutdown_timeout: float) -> int:
    """Serve until a shutdown signal (0) or the engine's death (1)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SOCKET_GRACE_S,
                            lifespan="off")
    server = LifecycleServer(config, engine, state, shutdown_timeout)
    server.run()
    return server.exit_code
