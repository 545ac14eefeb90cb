"""`config_dataclass`: a frozen pydantic dataclass whose errors name the field first.

pydantic checks the annotated types and constraints (`Annotated[int, Field(ge=1)]`,
`Literal[...]`) in strict mode, so `3.0` or `"3"` is not an int and `1` is not a bool.
A `ValidationError` is re-raised as `ConfigValueError` (a ValueError) whose message
starts with the field's name, e.g. "num_blocks must be >= 1, got 0", so callers (the
CLI, the HTTP layer) print it as it is. No JAX.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import pydantic
from pydantic import ConfigDict

T = TypeVar("T", bound=type)

_PHRASES = {
    "literal_error": "must be one of {expected}",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "bool_type": "must be a boolean",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "dict_type": "must be a dict",
    "list_type": "must be a list",
    "string_too_short": "must be non-empty",
}


class ConfigValueError(ValueError):
    """A bad configuration value; the message starts with the field's name."""


def _describe(error: dict[str, Any], prefix: str) -> str:
    """"name must be ..., got X"; an item of a list or dict: "name (item K) must be ..."."""
    name = prefix + str(error["loc"][0]) if error["loc"] else prefix.rstrip(".")
    if len(error["loc"]) > 1:
        name += f" (item {'.'.join(str(p) for p in error['loc'][1:])})"
    ctx = error.get("ctx") or {}
    if error["type"] == "value_error":  # a model validator's own ValueError: its message names the field
        return str(ctx.get("error", error["msg"]))
    phrase = _PHRASES.get(error["type"])
    text = phrase.format(**ctx) if phrase else error["msg"]
    return f"{name} {text}, got {error['input']!r}"


def config_dataclass(prefix: str = "", frozen: bool = True) -> Any:
    """Decorator: `cls` as a strict pydantic dataclass (frozen unless told) raising ConfigValueError.
    `prefix` goes before field names (e.g. "speculative_config.")."""
    def wrap(cls: T) -> T:
        cls = pydantic.dataclasses.dataclass(frozen=frozen, config=ConfigDict(strict=True))(cls)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except pydantic.ValidationError as exc:
                raise ConfigValueError("; ".join(_describe(e, prefix) for e in exc.errors())) from None

        cls.__init__ = __init__  # type: ignore[misc]
        return cls
    return wrap
