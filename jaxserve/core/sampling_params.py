"""Per-request sampling parameters, vLLM-compatible names and defaults.

Validation happens once, in `__post_init__`, and every error is a `ValueError`
whose message starts with the offending field's name, so the HTTP layer can
turn it into an OpenAI-shaped 400 and a notebook user sees what to fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top-N logprobs computed on device; OpenAI caps `top_logprobs` at 20 too


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
