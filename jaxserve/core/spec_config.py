"""`speculative_config` (vLLM's dict, e.g. `{"method": "ngram", "num_speculative_tokens": 3}`) as a
validated dataclass. The drafting itself is spec_decode.py's; this file is the flag only, so that
the scheduler's config (scheduler_output.py) can hold it without importing the algorithm. Pure Python."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, model_validator

from jaxserve.core.validation import config_dataclass

SpeculativeMethod = Literal["ngram"]
SPECULATIVE_METHODS = get_args(SpeculativeMethod)


@config_dataclass(prefix="speculative_config.")
class SpeculativeConfig:
    num_speculative_tokens: Annotated[int, Field(ge=1)]  # k: most drafts per request and step
    method: SpeculativeMethod = "ngram"
    prompt_lookup_max: Annotated[int, Field(ge=1)] = 4  # longest suffix n-gram looked up
    prompt_lookup_min: Annotated[int, Field(ge=1)] = 1  # shortest
    # Propose nothing in a step while more requests than this are running (None: no limit).
    disable_by_batch_size: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _check_lookup(self) -> "SpeculativeConfig":
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative_config.prompt_lookup_max must be >= prompt_lookup_min "
                             f"({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}")
        return self

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """EngineArgs.speculative_config (a dict, as vLLM takes it) -> a SpeculativeConfig; None stays None,
        and an empty dict (`--speculative-config '{}'`) is None too: no speculative decoding, which
        turns off the CPU's default (engine/config.py)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if value == {}:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 3}}, got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**value)
