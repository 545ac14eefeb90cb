"""What /v1/completions and /v1/chat/completions share: model-name and length checks,
prompt truncation, one engine stream per prompt (aborted when its
consumer goes away), logprob formatting and SSE framing.

Prompts are tokenized here, not in the engine, so the length checks (and the
`usage` counts) are made on exactly the token ids the engine will run.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
import anyio
from pydantic import BaseModel

from jaxserve.engine.outputs import LogprobsDict, RequestOutput
from jaxserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxserve.entrypoints.openai.engine_client import EngineClient
from jaxserve.engine.exceptions import EngineDeadError, RequestFailedError
from jaxserve.entrypoints.openai.errors import OpenAIError, from_server_fault
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.protocol import TopLogprob

logger = logging.getLogger("jaxserve.api_server")
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: BaseModel | dict[str, object]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(events: AsyncIterator[str], merged: AsyncGenerator) -> AsyncIterator[str]:
    """An endpoint's SSE events, then `[DONE]`; an error after the stream started is reported
    in-band (the status line is already sent) and the engine streams are closed either way."""
    try:
        async with aclosing(merged):
            async for event in events:
                yield event
    except OpenAIError as exc:
        yield sse(exc.to_dict())
    except Exception as exc:  # noqa: BLE001  (keep serving: one request's failure stays its own)
        if not isinstance(exc, (EngineDeadError, RequestFailedError)):
            logger.exception("internal error in a stream")
        yield sse(from_server_fault(exc).to_dict())
    yield SSE_DONE


class BaseServing:
    max_num_queued_reqs: int | None = None  # --max-num-queued-reqs (set by build_app)
    max_n_sequences: int = 16384  # --max-n-sequences (vLLM's VLLM_MAX_N_SEQUENCES default)

    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.vocab_size = len(engine.tokenizer)
        # --served-model-name's names (the first is reported), the generation config's defaults for
        # what a request leaves unset (engine/generation_config.py), --max-logprobs
        self.served_model_names: tuple[str, ...] = tuple(getattr(engine, "served_model_names", None)
                                                         or (engine.model_name,))
        self.default_sampling_params: dict[str, object] = dict(getattr(engine, "default_sampling_params", None) or {})
        self.max_logprobs: int = getattr(engine, "max_logprobs", MAX_LOGPROBS)

    # --- request checks ----------------------------------------------------------------------

    def check_model(self, model: str | None):
        """The LoRARequest `model` names (None: the base model), or a 404 for a model not served."""
        if model is None or model in self.served_model_names:
            return None
        manager = getattr(self.engine, "lora_manager", None)
        lora = manager.resolve(model) if manager is not None else None
        if lora is None:
            raise OpenAIError(f"The model `{model}` does not exist.", status=404, param="model",
                              code="model_not_found")
        return lora

    def response_model(self, model: str | None) -> str:
        """The `model` a response carries, as vLLM: the first served name for the base model (whichever
        of its names the request used), an adapter's own name for an adapter."""
        return self.engine.model_name if model is None or model in self.served_model_names else model

    def check_logprobs(self, num: int | None, param: str) -> None:
        """A 400 when a request asks for more logprobs than --max-logprobs (vLLM's check)."""
        if num is not None and num > self.max_logprobs:
            raise OpenAIError(f"{param} must be <= {self.max_logprobs} (--max-logprobs), got {num}", param=param,
                              code="invalid_value")

    def check_num_sequences(self, n: int, best_of: int | None) -> None:
        """A 400 when a request asks for more parallel samples than --max-n-sequences."""
        for param, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > self.max_n_sequences:
                raise OpenAIError(f"{param} must be <= {self.max_n_sequences} (--max-n-sequences), got {value}",
                                  param=param, code="invalid_value")

    def check_overload(self) -> None:
        """A 503 at once when --max-num-queued-reqs requests already wait beyond what the running
        slots (--max-num-seqs) take (after the request's own checks, before any work is queued): a
        burst into 2 free slots with a limit of 2 gets 4 answers. No await lies between this check
        and the engine registering the request, so each request of a burst counts the ones before it."""
        limit = self.max_num_queued_reqs
        waiting = getattr(self.engine, "num_waiting_beyond_capacity", None)
        if limit is not None and callable(waiting) and waiting() >= limit:
            raise OpenAIError(f"The server is overloaded: {limit} requests are already waiting; retry later",
                              status=503, code="server_overloaded")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size})", param=param,
                              code="invalid_value")

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, *, prompt_param: str,
                           max_tokens_param: str) -> int:
        """The number of tokens to generate, or a 400 when the prompt plus it does not fit the context."""
        limit = self.engine.max_model_len
        if num_prompt_tokens == 0:
            raise OpenAIError("The prompt is empty; at least one token is required", param=prompt_param)
        if num_prompt_tokens >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for a completion. Please shorten the prompt.",
                param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:  # the generation config's max_new_tokens, a default and not a ceiling (vLLM)
            default = self.default_sampling_params.get("max_tokens")
            return limit - num_prompt_tokens if default is None else min(int(default), limit - num_prompt_tokens)
        if max_tokens >= 1 and num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"in the completion). Please reduce the prompt or {max_tokens_param}.",
                param=max_tokens_param, code="context_length_exceeded")
        return max_tokens

    def truncate(self, prompt_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (-1: the context length less one)."""
        if truncate_prompt_tokens is None:
            return prompt_ids
        keep = self.engine.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        return prompt_ids[-keep:] if keep > 0 else prompt_ids

    # --- engine streams ----------------------------------------------------------------------

    async def stream(self, prompt_ids: list[int] | dict, params: SamplingParams, request_id: str,
                     *, prompt_logprobs: bool = False, lora_request=None) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for one prompt; records metrics when it finishes, aborts it otherwise."""
        finished = started = False
        extra = {"lora_request": lora_request} if lora_request is not None else {}
        outputs = self.engine.generate(prompt_ids, params, request_id, prompt_logprobs=prompt_logprobs, **extra)
        try:
            try:
                async for output in outputs:
                    started = True
                    if output.finished and not finished:
                        finished = True
                        if self.metrics is not None:
                            self.metrics.observe_finished(output)
                    yield output
            except ValueError as exc:
                if started:
                    raise
                finished = True  # the engine refused it before starting (prompt length, ...): nothing to abort
                raise  # a 400 naming the field, by the endpoint wrapper
        finally:
            with anyio.CancelScope(shield=True):
                if not finished:
                    await self.engine.abort(request_id)
                close = getattr(outputs, "aclose", None)
                if close is not None:
                    await close()

    # --- logprobs ----------------------------------------------------------------------------

    def decode_token(self, token_id: int, entries: LogprobsDict | None, as_id: bool = False) -> str:
        """The token's text; as_id (vLLM's return_tokens_as_token_ids): "token_id:N", which names
        a token whose bytes are not valid UTF-8 on their own."""
        if as_id:
            return f"token_id:{token_id}"
        entry = entries.get(token_id) if entries else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id])

    def top_entries(self, entries: LogprobsDict | None, num: int, as_id: bool = False) -> list[tuple[str, float]]:
        """The `num` best (decoded token, logprob) pairs at one position, best first."""
        if not entries or num <= 0:
            return []
        ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
        return [(self.decode_token(t, entries, as_id), max(lp.logprob, MIN_LOGPROB)) for t, lp in ranked[:num]]

    @staticmethod
    def sampled_logprob(token_id: int, entries: LogprobsDict | None) -> float | None:
        entry = entries.get(token_id) if entries else None
        return None if entry is None else max(entry.logprob, MIN_LOGPROB)

    def chat_logprob(self, token_id: int, entries: LogprobsDict | None, num: int,
                     as_id: bool = False) -> dict[str, object]:
        token = self.decode_token(token_id, entries, as_id)
        logprob = self.sampled_logprob(token_id, entries)
        top = [TopLogprob(token=t, logprob=lp, bytes=list(t.encode())).model_dump()
               for t, lp in self.top_entries(entries, num, as_id)]
        return {"token": token, "logprob": MIN_LOGPROB if logprob is None else logprob,
                "bytes": list(token.encode()), "top_logprobs": top}
