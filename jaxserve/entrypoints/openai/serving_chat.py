"""POST /v1/chat/completions: messages through the chat template, then one engine request.

The template is rendered to text and tokenized without special tokens: the
template already writes them (BOS, role markers), and tokenizing with them
would add a second BOS. Streaming sends, per choice, a first chunk with the
role, then content deltas, and the finish_reason on the choice's last chunk.

The text a choice generated becomes a message in `_message`: with a reasoning parser
its `<think>` part goes to `reasoning`; with tools, a forced tool_choice's output (or,
under "auto", what the tool parser finds) becomes `tool_calls`. Streaming sends the
same message as deltas: reasoning and content as they grow, a named function's
arguments as they grow, other calls once the choice has finished (a call is only
known when its JSON is complete).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.entrypoints.openai.engine_client import EngineClient
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                                  ChatResponseMessage, ChatStreamChoice, DeltaMessage, DeltaToolCall,
                                                  UsageInfo)
from jaxserve.entrypoints.openai.serving_engine import BaseServing, random_id, sse, sse_stream
from jaxserve.entrypoints.openai.streams import merge_streams, prime, until_disconnected
from jaxserve.entrypoints.openai.structured import NamedToolChoice
from jaxserve.entrypoints.openai.tool_calls import forced_calls, forced_tool_schema, parse_auto, split_reasoning
from jaxserve.multimodal.serving import chat_images_async, with_images


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


def conversation(messages: list[ChatMessage], keep_parts: bool = False) -> list[dict[str, object]]:
    """Messages as the template expects them: content parts joined into one string (keep_parts, a
    vision-language model: left as parts, its template places the images)."""
    result: list[dict[str, object]] = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        item.setdefault("content", "")  # an assistant turn that only called tools: templates read content
        for call in item.get("tool_calls") or []:  # templates index arguments as a mapping
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass
        if isinstance(message.content, list) and keep_parts:
            item["content"] = [part.model_dump(exclude_none=True) for part in message.content]
        elif isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise OpenAIError(f"Content part type {part.type!r} is not supported; only 'text' is",
                                      param=f"messages.{i}.content")
                texts.append(part.text)
            item["content"] = "\n".join(texts)
        result.append(item)
    return result


# apply_chat_template's own arguments: the server decides these, a request's template kwargs may not.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
    "truncation", "max_length", "return_tensors"})


class ServingChat(BaseServing):
    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None, chat_template: str | None, *,
                 trust_request_chat_template: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        super().__init__(engine, metrics)
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    def render(self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, template: str | None = None,
               kwargs: dict[str, object] | None = None, tools: list[dict[str, object]] | None = None,
               conv: list[dict[str, object]] | None = None) -> list[int]:
        """`conv`: the conversation already made from `messages` (with its image parts read)."""
        try:
            text = self.tokenizer.apply_chat_template(
                conv if conv is not None else conversation(messages), tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=template or self.chat_template,
                tools=tools, **(kwargs or {}))
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001  (jinja errors, a model without a template)
            raise OpenAIError(f"Cannot apply the chat template: {exc}", param="messages") from None
        return self.encode(str(text), add_special_tokens=False)

    def _check(self, req: ChatCompletionRequest):
        """The request's LoRARequest (None: the base model), or an OpenAIError."""
        lora = self.check_model(req.model)
        self.check_num_sequences(req.n, None)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError("chat_template: a request may only pass a chat template when the server runs with "
                              "--trust-request-chat-template", param="chat_template", code="chat_template_not_allowed")
        reserved = sorted(set(req.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:  # (vLLM's advisory: a template smuggled in here would run unreviewed Jinja)
            raise OpenAIError(f"chat_template_kwargs: may not set {reserved[0]!r}", param="chat_template_kwargs",
                              code="invalid_value")
        if req.tool_choice == "auto" and self.tool_parser is None:
            raise OpenAIError('tool_choice: "auto" needs the server to run with --enable-auto-tool-choice and '
                              "--tool-call-parser", param="tool_choice")
        return lora

    def _auto_tools(self, req: ChatCompletionRequest) -> bool:
        """Parse calls from free text: tool_choice auto (explicit, or the default when tools are given)."""
        return bool(req.tools) and self.tool_parser is not None and req.tool_choice in (None, "auto")

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        lora = self._check(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        conv, images = await chat_images_async(self.engine, req, conversation)  # a vision-language model's image parts
        prompt_ids = self.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message, template=req.chat_template,
                                 kwargs=req.chat_template_kwargs, tools=tools, conv=conv)
        prompt_ids = self.truncate(prompt_ids, req.truncate_prompt_tokens)
        prompt, prompt_ids = await with_images(self.engine, prompt_ids, images, req.truncate_prompt_tokens)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested, prompt_param="messages",
                                             max_tokens_param="max_completion_tokens")
        self.check_token_ids(list(req.token_logit_bias() or {}), "logit_bias")
        params = req.to_sampling_params(max_tokens, self.default_sampling_params,
                                        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                        structured_outputs=req.structured_params(forced_tool_schema(req)),
                                        use_beam_search=req.use_beam_search, length_penalty=req.length_penalty)
        self.check_overload()
        request_id = random_id("chatcmpl")
        streams = [self.stream(prompt, params, request_id, lora_request=lora)]
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
        as_id = bool(req.return_tokens_as_token_ids)  # vLLM's: "token_id:N" for each token
        content = [self.chat_logprob(t, positions[k] if k < len(positions) else None, num, as_id)
                   for k, t in enumerate(out.token_ids) if k >= start]
        return ChatLogprobs.model_validate({"content": content})

    def _message(self, req: ChatCompletionRequest, text: str) -> ChatResponseMessage:
        """One choice's generated text as a message: reasoning, content and tool calls split out."""
        reasoning, content = split_reasoning(text) if self.reasoning_parser else (None, text)
        calls = []
        if forced_tool_schema(req) is not None:
            calls, content = forced_calls(req, content), ""
        elif self._auto_tools(req):
            content, calls = parse_auto(self.tool_parser or "", content)  # type: ignore[assignment]
        return ChatResponseMessage(content=content or (None if calls else content), reasoning=reasoning,
                                   reasoning_content=reasoning, tool_calls=calls)

    @staticmethod
    def _finish_reason(message: ChatResponseMessage, out: CompletionOutput) -> str | None:
        return "tool_calls" if message.tool_calls and out.finish_reason == "stop" else out.finish_reason

    def _response(self, req: ChatCompletionRequest, request_id: str, final: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for j, out in enumerate(final.outputs[:req.n]):
            message = self._message(req, out.text)
            choices.append(ChatChoice(index=j, message=message, logprobs=self._logprobs(req, out, 0),
                                      finish_reason=self._finish_reason(message, out), stop_reason=out.stop_reason))
        num_prompt = len(final.prompt_token_ids)
        num_generated = sum(len(out.token_ids) for out in final.outputs[:req.n])
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                          total_tokens=num_prompt + num_generated)
        return ChatCompletionResponse(id=request_id, model=self.response_model(req.model), choices=choices,
                                      usage=usage)

    async def _events(self, req: ChatCompletionRequest, request_id: str, num_prompt: int,
                      merged: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        model = self.response_model(req.model)  # an adapter answers under its own name (vLLM)

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]))

        for j in range(req.n):
            yield chunk(ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")))
        sent = [_Sent() for _ in range(req.n)]
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        async for _, output in merged:
            for j, out in enumerate(output.outputs[:req.n]):
                if len(out.text) == sent[j].text and len(out.token_ids) == sent[j].tokens and out.finish_reason is None:
                    continue
                logprobs = self._logprobs(req, out, sent[j].tokens)
                delta, finish = self._delta(req, out, sent[j])
                sent[j].tokens = len(out.token_ids)
                yield sse(ChatCompletionChunk(
                    id=request_id, model=model, choices=[ChatStreamChoice(
                        index=j, delta=delta, logprobs=logprobs, finish_reason=finish, stop_reason=out.stop_reason)],
                    usage=self._usage(num_prompt, sent) if continuous else None))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=self._usage(num_prompt, sent)))

    @staticmethod
    def _usage(num_prompt: int, sent: list[_Sent]) -> UsageInfo:
        total = sum(s.tokens for s in sent)
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total)

    def _delta(self, req: ChatCompletionRequest, out: CompletionOutput, sent: _Sent) -> tuple[DeltaMessage, str | None]:
        """What the choice adds since `sent`, as a delta, and its finish_reason once it has finished."""
        sent.text = len(out.text)
        reasoning, content = split_reasoning(out.text) if self.reasoning_parser else (None, out.text)
        delta = DeltaMessage(content="")
        if reasoning and len(reasoning) > sent.reasoning:
            delta.reasoning = delta.reasoning_content = reasoning[sent.reasoning:]
            sent.reasoning = len(reasoning)
        finish = out.finish_reason
        if isinstance(req.tool_choice, NamedToolChoice):  # the arguments stream as they grow
            call = DeltaToolCall(index=0, function={"arguments": content[sent.content:]})
            if sent.content == 0 and not sent.called:
                call.id, call.type = f"call_{uuid.uuid4().hex[:24]}", "function"
                call.function["name"] = req.tool_choice.function.name
                sent.called = True
            delta.tool_calls = [call]
            sent.content = len(content)
            return delta, "tool_calls" if finish == "stop" else finish
        if forced_tool_schema(req) is not None or self._auto_tools(req):
            if finish is None:
                return delta, None  # a call is known only once its JSON is complete
            message = self._message(req, out.text)
            delta.content = message.content
            delta.tool_calls = [DeltaToolCall(index=k, id=c.id, type="function", function=c.function.model_dump())
                                for k, c in enumerate(message.tool_calls)] or None
            return delta, self._finish_reason(message, out)
        delta.content = content[sent.content:]
        sent.content = max(sent.content, len(content))
        return delta, finish


class _Sent:
    """What one streamed choice has sent so far (characters of text, reasoning and content; tokens)."""

    def __init__(self) -> None:
        self.text = self.reasoning = self.content = self.tokens = 0
        self.called = False
