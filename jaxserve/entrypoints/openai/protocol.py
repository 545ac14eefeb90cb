"""Request and response schemas of the OpenAI-compatible API, in pydantic.

Declared request fields are validated strictly (`strict=True`: "5" is not an int,
`true` is not a number). Unknown fields are accepted and logged, as vLLM does:
SDKs and frameworks (LangChain, the Agents SDK) send fields that change nothing a
server like this one does (`store`, `metadata`, `service_tier`, `prediction`,
`reasoning_effort`, ...). Some fields would change the answer if honoured, so
dropping them silently would hand back something the client did not ask for;
those are refused with a 400 naming the field (`REFUSED_FIELDS`):

    functions, function_call   the legacy tool API: the model would never see the
                               functions, and no function_call could come back
    audio, modalities          audio output; only text is generated here
    web_search_options         asks for a web search the server cannot run
    logits_processors          vLLM's per-request Python callables: none run here
    prompt_logprobs            (chat) vLLM's prompt logprobs, not wired for chat
    guided_decoding_backend    names another grammar library's behaviour

A request becomes engine parameters in one place, `to_sampling_params()` (chat and
completions share it); a ValueError from it (its message starts with the field's
name) is turned into an OpenAI 400 by the server's endpoint wrapper. The same
models generate `/openapi.json`.
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.openai.structured import ChatTool, StructuredFields, ToolChoice

logger = logging.getLogger("jaxserve.protocol")
REFUSED_FIELDS = {
    "functions": "the legacy function-calling API is not supported; use tools",
    "function_call": "the legacy function-calling API is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "web_search_options": "web search is not supported",
    "logits_processors": "per-request logits processors are not supported",
    "guided_decoding_backend": "the grammar library is fixed (llguidance); remove this field",
}

# Prompts: one string, many strings, one token-id list, or many token-id lists.
PromptInput = str | list[str] | list[int] | list[list[int]]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # NaN/Infinity: a 400
    REFUSED: ClassVar[dict[str, str]] = REFUSED_FIELDS

    @model_validator(mode="after")
    def _unknown_fields(self) -> _Request:
        extra = set(self.model_extra or {})
        refused = sorted(extra & set(self.REFUSED))
        if refused:
            raise ValueError(f"{refused[0]}: {self.REFUSED[refused[0]]}")
        if extra:
            logger.info("%s: ignoring unknown fields %s", type(self).__name__, sorted(extra))
        return self


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk, not only the last


class _SamplingFields(StructuredFields, _Request):
    """Fields /v1/completions and /v1/chat/completions share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last k (-1: max_model_len)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: with logprobs, each token (and top-N key) as "token_id:N" instead of its text
    return_tokens_as_token_ids: bool | None = None
    # Accepted, no effect: no storage, no tiers here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # SamplingParams' names for what this request calls differently.
    ALIASES: ClassVar[dict[str, str]] = {}

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, object] | None = None,
                           **overrides: object) -> SamplingParams:
        """The engine parameters; ValueError names the request's field (see errors.from_value_error).
        `defaults`: the generation config's (engine/generation_config.py), for the sampling fields the
        request leaves unset (null or absent), as vLLM's to_sampling_params; else vLLM's own defaults."""
        defaults = defaults or {}

        def pick(name: str, builtin: object) -> object:
            value = getattr(self, name)
            return defaults.get(name, builtin) if value is None else value

        kwargs: dict[str, object] = dict(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, repetition_penalty=pick("repetition_penalty", 1.0),
            stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.token_logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words)
        kwargs.update(overrides)
        if kwargs.get("use_beam_search") and self.temperature is None:
            kwargs["temperature"] = 1.0  # beam search does not sample: a default temperature does not apply
        if "structured_outputs" not in kwargs:
            kwargs["structured_outputs"] = self.structured_params()
        try:
            return SamplingParams(**kwargs)  # type: ignore[arg-type]  # typed by this schema
        except ValueError as exc:
            name, _, rest = str(exc).partition(" ")
            raise ValueError(f"{self.ALIASES.get(name, name)} {rest}") from None

    def token_logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings)") from None


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # accepted for schema compatibility; a non-null value is refused
    use_beam_search: bool = False
    length_penalty: float = 1.0


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, object]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this result answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless the server runs with --trust-request-chat-template
    chat_template_kwargs: dict[str, object] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    use_beam_search: bool = False  # vLLM's: n beams (beam_width = n), ranked with length_penalty
    length_penalty: float = 1.0
    REFUSED: ClassVar[dict[str, str]] = {**REFUSED_FIELDS, "prompt_logprobs": "prompt logprobs are not "
                                         "supported on chat; use /v1/completions with echo and logprobs"}
    ALIASES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# --- responses -------------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # --reasoning-parser: the model's thinking
    reasoning_content: str | None = None  # the same, under vLLM's older name
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None  # {"name"?, "arguments"}


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # OpenAI sends {"role": "assistant", "content": ""} first and {"content": "..."} after.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM)
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
