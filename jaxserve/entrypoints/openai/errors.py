"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Handlers raise `OpenAIError`; the app turns it into a JSON response. Every other
failure path (pydantic validation, a request's or the engine's ValueError, whose
message starts with the field's name) is translated here so the shapes stay in one
place; the server's endpoint wrapper is the one caller.
"""

from __future__ import annotations

import re

from pydantic import ValidationError
from starlette.responses import JSONResponse

from jaxserve.engine.exceptions import EngineDeadError, EngineSleepingError, RequestFailedError
from jaxserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def to_dict(self) -> dict[str, object]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status)


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """The first pydantic error decides the message and the `param` (a dotted field path)."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return OpenAIError(f"Invalid JSON body: {err['msg']}", code="invalid_json")
    if err["type"] == "model_type" and not err["loc"]:
        return OpenAIError("The request body must be a JSON object", code="invalid_type")
    # Union members show up in the location ("prompt", "list[int]", 0); keep field names and indices.
    names = [str(part) for part in err["loc"] if isinstance(part, int) or ("[" not in part and part != "str")]
    param = ".".join(names) or None
    if err["type"] == "value_error":  # a model validator's ValueError: its message names the field
        return from_value_error(ValueError(str(err["msg"]).removeprefix("Value error, ")), default_param=param)
    if err["type"] == "extra_forbidden":
        return OpenAIError(f"Unrecognized request argument supplied: {param}", param=param,
                           code="unrecognized_argument")
    if err["type"] == "missing":
        return OpenAIError(f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    return OpenAIError(f"Invalid value for '{param}': {err['msg']}", param=param, code="invalid_value")


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*):?\s")


def from_value_error(exc: ValueError, *, default_param: str | None = None) -> OpenAIError:
    """A 400 whose `param` is the field the message starts with (`name ...` or `name: ...`)."""
    message = str(exc)
    match = _FIELD.match(message)
    param = match.group(1) if match and ("_" in match.group(1) or match.group(1).islower()) else default_param
    return OpenAIError(message, param=param, code="invalid_value")


def from_server_fault(exc: Exception) -> OpenAIError:
    """A 500 for a failure that is not the request's fault. The engine's own kinds keep their message
    (code: the kind); anything else says only its type: bodies never carry paths, addresses or
    tracebacks (the log has them)."""
    if isinstance(exc, EngineSleepingError):  # asleep, or weights dropped by sleep level 2: says what wakes it
        return OpenAIError(str(exc), status=503, code="engine_sleeping")
    if isinstance(exc, (EngineDeadError, RequestFailedError)):
        return OpenAIError(str(exc), status=500, code=type(exc).__name__)
    return OpenAIError(f"Internal server error ({type(exc).__name__})", status=500)
