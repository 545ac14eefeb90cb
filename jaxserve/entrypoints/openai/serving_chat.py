"""POST /v1/chat/completions: messages through the chat template, then one engine request.

The template is rendered to text and tokenized without special tokens: the
template already writes them (BOS, role markers), and tokenizing with them
would add a second BOS. Streaming sends, per choice, a first chunk with the
role, then content deltas, and the finish_reason on the choice's last chunk.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.entrypoints.openai.engine_client import EngineClient
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                                  ChatResponseMessage, ChatStreamChoice, DeltaMessage, UsageInfo)
from jaxserve.entrypoints.openai.serving_engine import BaseServing, random_id, sse, sse_stream
from jaxserve.entrypoints.openai.streams import merge_streams, prime, until_disconnected

# SamplingParams' names for what the chat request calls differently.
_CHAT_ALIASES = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


def load_chat_template(template: str | None) -> str | None:
    """`--chat-template` is a file path or the (Jinja) template itself."""
    if template is None or os.path.isfile(template):
        if template is None:
            return None
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{" not in template:
        raise ValueError(f"chat_template {template!r} is neither a file nor a Jinja template")
    return template


def conversation(messages: list[ChatMessage]) -> list[dict[str, object]]:
    """Messages as the template expects them: content parts joined into one string."""
    result: list[dict[str, object]] = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise OpenAIError(f"Content part type {part.type!r} is not supported; only 'text' is",
                                      param=f"messages.{i}.content")
                texts.append(part.text)
            item["content"] = "\n".join(texts)
        result.append(item)
    return result


class ServingChat(BaseServing):
    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None, chat_template: str | None) -> None:
        super().__init__(engine, metrics)
        self.chat_template = chat_template

    def render(self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, template: str | None = None,
               kwargs: dict[str, object] | None = None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                conversation(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=template or self.chat_template,
                **(kwargs or {}))
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001  (jinja errors, a model without a template)
            raise OpenAIError(f"Cannot apply the chat template: {exc}", param="messages") from None
        return self.encode(str(text), add_special_tokens=False)

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt_ids = self.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message, template=req.chat_template,
                                 kwargs=req.chat_template_kwargs)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested, prompt_param="messages",
                                             max_tokens_param="max_completion_tokens")
        params = self.sampling_params(
            _CHAT_ALIASES, n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            seed=req.seed, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            stop=req.stop, stop_token_ids=req.stop_token_ids, include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None, skip_special_tokens=req.skip_special_tokens,
            logit_bias=self.logit_bias(req.logit_bias))
        request_id = random_id("chatcmpl")
        streams = [self.stream(prompt_ids, params, request_id)]
        merged = merge_streams(await prime(streams), streams)
        if req.stream:
            return StreamingResponse(sse_stream(self._events(req, request_id, len(prompt_ids), merged), merged),
                                     media_type="text/event-stream")
        completed, final = await until_disconnected(request, self._last(merged))
        if not completed or final is None:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        return JSONResponse(self._response(req, request_id, final).model_dump())

    @staticmethod
    async def _last(merged: AsyncIterator[tuple[int, RequestOutput]]) -> RequestOutput | None:
        last = None
        async for _, output in merged:
            last = output
        return last

    def _logprobs(self, req: ChatCompletionRequest, out: CompletionOutput, start: int) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        positions = list(out.logprobs or [])
        num = req.top_logprobs or 0
        content = [self.chat_logprob(t, positions[k] if k < len(positions) else None, num)
                   for k, t in enumerate(out.token_ids) if k >= start]
        return ChatLogprobs.model_validate({"content": content})

    def _response(self, req: ChatCompletionRequest, request_id: str, final: RequestOutput) -> ChatCompletionResponse:
        choices = [ChatChoice(index=j, message=ChatResponseMessage(content=out.text),
                              logprobs=self._logprobs(req, out, 0), finish_reason=out.finish_reason,
                              stop_reason=out.stop_reason)
                   for j, out in enumerate(final.outputs[:req.n])]
        num_prompt = len(final.prompt_token_ids)
        num_generated = sum(len(out.token_ids) for out in final.outputs[:req.n])
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                          total_tokens=num_prompt + num_generated)
        return ChatCompletionResponse(id=request_id, model=self.engine.model_name, choices=choices, usage=usage)

    async def _events(self, req: ChatCompletionRequest, request_id: str, num_prompt: int,
                      merged: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        model = self.engine.model_name

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]))

        for j in range(req.n):
            yield chunk(ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")))
        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        async for _, output in merged:
            for j, out in enumerate(output.outputs[:req.n]):
                delta = out.text[sent_text[j]:]
                if not delta and len(out.token_ids) == sent_tokens[j] and out.finish_reason is None:
                    continue
                logprobs = self._logprobs(req, out, sent_tokens[j])
                sent_text[j] = max(sent_text[j], len(out.text))
                sent_tokens[j] = len(out.token_ids)
                yield chunk(ChatStreamChoice(index=j, delta=DeltaMessage(content=delta), logprobs=logprobs,
                                             finish_reason=out.finish_reason, stop_reason=out.stop_reason))
        if req.stream_options is not None and req.stream_options.include_usage:
            total = sum(sent_tokens)
            usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total)
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage))
