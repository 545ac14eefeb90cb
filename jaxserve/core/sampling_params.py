"""Per-request sampling parameters, vLLM-compatible names and defaults.

Validation happens once, in `__post_init__`, and every error is a `ValueError`
whose message starts with the offending field's name, so the HTTP layer can
turn it into an OpenAI-shaped 400 and a notebook user sees what to fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_LOGPROBS = 20  # top-N logprobs computed on device; OpenAI caps `top_logprobs` at 20 too


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
    # Compact JSON: no whitespace between tokens (the default here, see structured_output.py).
    disable_any_whitespace: bool = True

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


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    # Token-level constraints, applied on the device through one token bitmask per row
    # (core/structured_output.py fills it): only these ids may be sampled / never these words.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine, not the user: the model's end-of-sequence ids.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.best_of is None:
            self.best_of = self.n
        if self.use_beam_search and self.beam_width is None:
            self.beam_width = self.best_of
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        check(is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        check(is_int(self.best_of) and self.best_of >= self.n, "best_of",
              f"must be an integer >= n ({self.n}), got {self.best_of!r}")
        check(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
              "temperature", f"must be in [0, 100], got {self.temperature!r}")
        check(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
              "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k",
              f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        check(isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0,
              "min_p", f"must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and -2.0 <= v <= 2.0, name, f"must be in [-2, 2], got {v!r}")
        check(isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 2.0,
              "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be a non-empty string or a list of non-empty strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be a list of non-negative integers")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens",
                  f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS), name,
                  f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to biases")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            check(all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias",
                  "values must be in [-100, 100]")
        if self.use_beam_search:
            check(is_int(self.beam_width) and self.beam_width >= 1, "beam_width",
                  f"must be an integer >= 1, got {self.beam_width!r}")
            check(self.temperature == 0.0 or self.temperature == 1.0, "temperature",
                  "is not used by beam search; leave it at 0 or 1")
        check(isinstance(self.length_penalty, (int, float)), "length_penalty", "must be a number")
        if self.allowed_token_ids is not None:
            check(isinstance(self.allowed_token_ids, list) and len(self.allowed_token_ids) > 0
                  and all(is_int(t) and t >= 0 for t in self.allowed_token_ids), "allowed_token_ids",
                  "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None:
            check(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                  "bad_words", "must be a list of non-empty strings")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams")

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
