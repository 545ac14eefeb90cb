"""The engine's failure kinds, as vLLM names them, so the server can tell them apart.

    EngineDeadError     the engine loop stopped (a failed step, a bug): every request in flight
                        ends with it, new ones are refused (503), the server exits non-zero
    RequestFailedError  one request's own input made the step fail (the loop knows which):
                        that request alone ends with an error, the others carry on
    RequestAbortedError a pooling request aborted before its step (it has no partial result to
                        return, unlike a generation's finish_reason "abort")
    EngineSleepingError generation asked of an engine asleep (or paused, or whose weights sleep
                        level 2 dropped): the message says which call brings it back
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    def __init__(self, message: str = "The engine has stopped after an error; the server is shutting down") -> None:
        super().__init__(message)


class RequestFailedError(RuntimeError):
    """Raised inside a step, before it changes any state, by code that knows which request is at fault."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class RequestAbortedError(RuntimeError):
    """A pooling request ended before its step (an abort, a graceful shutdown): it has no result."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} was aborted before it ran (the server is shutting down, "
                         "or the request was cancelled)")
        self.request_id = request_id


class EngineSleepingError(RuntimeError):
    """Generation asked of an engine that cannot run it now (engine/sleep.py): asleep, paused for a
    blocking generate(), or its weights dropped by sleep(level=2) and not yet replaced."""
