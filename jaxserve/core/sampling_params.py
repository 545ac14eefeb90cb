"""Per-request sampling parameters, vLLM-compatible names and defaults.

A pydantic dataclass (strict: `1.0` is not an int, `True` not a number): each
field's range is in its annotation, the checks that read several fields are in
`_check_together`. Every error is a `ValueError` whose message starts with the
offending field's name, so the HTTP layer can turn it into an OpenAI-shaped 400
and a notebook user sees what to fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from jaxserve.core.validation import config_dataclass

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_LOGPROBS = 20  # top-N logprobs computed on device; OpenAI caps `top_logprobs` at 20 too

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TopN = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of `json` (a JSON schema, as a dict or a string),
    `regex`, `choice` (a list of strings), `grammar` (Lark, or GBNF when it holds `::=`) or
    `json_object` (any JSON object). Grammars are compiled by core/structured_output.py."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's: False (its default) lets whitespace go between JSON tokens; True allows none.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                             f"got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its string)")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))



@config_dataclass(frozen=False)
class SamplingParams:
    n: Annotated[int, Field(ge=1)] = 1
    best_of: int | None = None  # None: n
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # 0 or -1: disabled
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    stop: list[Annotated[str, Field(min_length=1)]] = field(default_factory=list)  # a string: one stop string
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    min_tokens: Annotated[int, Field(ge=0)] = 0
    logprobs: TopN | None = None
    prompt_logprobs: TopN | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    use_beam_search: bool = False
    beam_width: Annotated[int, Field(ge=1)] | None = None  # None: best_of
    length_penalty: float = 1.0
    # Token-level constraints, applied on the device through one token bitmask per row
    # (core/structured_output.py fills it): only these ids may be sampled / never these words.
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    # Filled by the engine, not the user: the model's end-of-sequence ids.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _as_list(cls, value: object) -> object:
        """One stop string may be given bare; None means none."""
        return [value] if isinstance(value, str) else ([] if value is None else value)

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_disabled(cls, value: object) -> object:
        return 0 if value == -1 and not isinstance(value, bool) else value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, value: object) -> object:
        """JSON object keys are strings: "123" -> 123, as OpenAI's API takes them."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("logit_bias must map token ids to biases")
        try:
            return {int(k): float(v) for k, v in value.items()}
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map token ids to biases") from None

    @model_validator(mode="after")
    def _check_together(self) -> "SamplingParams":
        if self.best_of is None:
            self.best_of = self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.use_beam_search:
            if self.beam_width is None:
                self.beam_width = self.best_of
            if self.temperature not in (0.0, 1.0):
                raise ValueError("temperature is not used by beam search; leave it at 0 or 1")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        return self

    @property
    def needs_token_mask(self) -> bool:
        """The row's allowed tokens depend on more than the logits: a bitmask row is filled for it."""
        return bool(self.allowed_token_ids or self.bad_words or self.structured_outputs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_sort(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0
