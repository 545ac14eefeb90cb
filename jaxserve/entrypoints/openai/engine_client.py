"""What the HTTP layer needs from an engine: the `AsyncLLM` surface, as a Protocol.

The server is written against this so tests can serve a fake engine and the
real one (jaxserve.engine.async_llm.AsyncLLM) needs no common base class.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from jaxserve.engine.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.stats import EngineStats


class EngineClient(Protocol):
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    block_size: int  # KV block tokens (the platform's default when the flag was not given)
    model_name: str

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str,
                 *, prompt_logprobs: bool = False) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs, the last with finished=True; ValueError before the first for bad input."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def get_stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...
