"""POST /v1/completions: one engine request per prompt, merged into OpenAI's response or SSE chunks.

Choice indices: prompt p's output j is choice `p * n + j`, as in the OpenAI API.
The engine's outputs are cumulative; streaming sends the difference to what
each choice has already sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.engine.outputs import CompletionOutput, LogprobsDict, RequestOutput
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                                  CompletionResponse, UsageInfo)
from jaxserve.entrypoints.openai.serving_engine import BaseServing, random_id, sse, sse_stream
from jaxserve.entrypoints.openai.streams import merge_streams, prime, until_disconnected


class ServingCompletion(BaseServing):
    async def create(self, req: CompletionRequest, request: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_num_sequences(req.n, req.best_of)
        self.check_logprobs(req.logprobs, "logprobs")
        if req.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if req.stream and req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of must equal n when streaming", param="best_of")
        prompts = self._prompts(req)
        want_prompt_logprobs = req.echo and req.logprobs is not None
        request_id = random_id("cmpl")
        streams = []
        self.check_token_ids(list(req.token_logit_bias() or {}), "logit_bias")
        structured = req.structured_params()  # validated once for all prompts
        max_tokens_each = [self.resolve_max_tokens(len(ids), req.max_tokens, prompt_param="prompt",
                                                   max_tokens_param="max_tokens") for _, ids in prompts]
        self.check_overload()
        for i, (_, ids) in enumerate(prompts):
            max_tokens = max_tokens_each[i]
            params = req.to_sampling_params(
                max_tokens, self.default_sampling_params, best_of=req.best_of, logprobs=req.logprobs,
                structured_outputs=structured,
                prompt_logprobs=req.logprobs if want_prompt_logprobs else None,
                use_beam_search=req.use_beam_search, length_penalty=req.length_penalty)
            streams.append(self.stream(ids, params, f"{request_id}-{i}", prompt_logprobs=want_prompt_logprobs,
                                       lora_request=lora))
        firsts = await prime(streams)
        merged = merge_streams(firsts, streams)
        if req.stream:
            return StreamingResponse(sse_stream(self._events(req, request_id, prompts, merged), merged),
                                     media_type="text/event-stream")
        completed, finals = await until_disconnected(request, self._collect(merged, len(prompts)))
        if not completed or finals is None:
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        return JSONResponse(self._response(req, request_id, prompts, finals).model_dump())

    def _prompts(self, req: CompletionRequest) -> list[tuple[str, list[int]]]:
        """(prompt text, token ids) per prompt."""
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]  # type: ignore[list-item]  # one prompt
        if not raw:
            raise OpenAIError("prompt must not be empty", param="prompt")
        prompts: list[tuple[str, list[int]]] = []
        for item in raw:
            if isinstance(item, str):
                prompts.append((item, self.truncate(self.encode(item), req.truncate_prompt_tokens)))
            else:
                ids = list(item)  # type: ignore[arg-type]  # list[int] by the schema
                self.check_token_ids(ids, "prompt")
                prompts.append((self.tokenizer.decode(ids), ids))
        return prompts

    @staticmethod
    async def _collect(merged: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * num_prompts
        async for index, output in merged:
            finals[index] = output
        return [f for f in finals if f is not None]

    def _logprobs(self, token_ids: list[int], positions: list[LogprobsDict | None], num: int,
                  start_offset: int = 0, out: CompletionLogprobs | None = None,
                  as_id: bool = False) -> CompletionLogprobs:
        """as_id: the request's return_tokens_as_token_ids (tokens and top-N keys as "token_id:N")."""
        out = out or CompletionLogprobs()
        offset = start_offset
        for token_id, entries in zip(token_ids, positions):
            token = self.decode_token(token_id, entries, as_id)
            out.tokens.append(token)
            out.token_logprobs.append(self.sampled_logprob(token_id, entries))
            top = dict(self.top_entries(entries, num, as_id)) if entries else None
            if top is not None and token_id in entries:  # OpenAI's shape, as vLLM: the chosen token too (so
                top.setdefault(token, self.sampled_logprob(token_id, entries))  # up to logprobs + 1 entries)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _choice(self, req: CompletionRequest, index: int, prompt: tuple[str, list[int]], final: RequestOutput,
                output: CompletionOutput) -> CompletionChoice:
        text = (prompt[0] if req.echo else "") + output.text
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if req.echo:
                self._logprobs(prompt[1], list(final.prompt_logprobs or [None] * len(prompt[1])), req.logprobs,
                               out=logprobs, as_id=bool(req.return_tokens_as_token_ids))
            start = sum(len(t) for t in logprobs.tokens)
            self._logprobs(output.token_ids, list(output.logprobs or []), req.logprobs, start, logprobs,
                           bool(req.return_tokens_as_token_ids))
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=output.finish_reason,
                                stop_reason=output.stop_reason)

    def _response(self, req: CompletionRequest, request_id: str, prompts: list[tuple[str, list[int]]],
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        num_generated = 0
        for p, (prompt, final) in enumerate(zip(prompts, finals)):
            for j, output in enumerate(final.outputs[:req.n]):
                choices.append(self._choice(req, p * req.n + j, prompt, final, output))
                num_generated += len(output.token_ids)
        num_prompt = sum(len(ids) for _, ids in prompts)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                          total_tokens=num_prompt + num_generated)
        return CompletionResponse(id=request_id, model=self.response_model(req.model), choices=choices,
                                  usage=usage)

    async def _events(self, req: CompletionRequest, request_id: str, prompts: list[tuple[str, list[int]]],
                      merged: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        sent_text: dict[int, int] = {}  # choice index -> characters sent
        sent_tokens: dict[int, int] = {}
        model = self.response_model(req.model)  # an adapter answers under its own name (vLLM)
        num_prompt = sum(len(ids) for _, ids in prompts)
        async for p, output in merged:
            prompt_text, prompt_ids = prompts[p]
            for j, out in enumerate(output.outputs[:req.n]):
                index = p * req.n + j
                first = index not in sent_text
                done_text, done_tokens = sent_text.get(index, 0), sent_tokens.get(index, 0)
                delta, new_ids = out.text[done_text:], out.token_ids[done_tokens:]
                if not (first and req.echo) and not delta and not new_ids and out.finish_reason is None:
                    continue
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    if first and req.echo:
                        prompt_positions = list(output.prompt_logprobs or [None] * len(prompt_ids))
                        self._logprobs(prompt_ids, prompt_positions, req.logprobs, out=logprobs,
                                       as_id=bool(req.return_tokens_as_token_ids))
                    self._logprobs(new_ids, list((out.logprobs or [])[done_tokens:]), req.logprobs,
                                   done_text, logprobs, bool(req.return_tokens_as_token_ids))
                sent_text[index] = max(done_text, len(out.text))
                sent_tokens[index] = len(out.token_ids)
                choice = CompletionChoice(index=index, text=(prompt_text if first and req.echo else "") + delta,
                                          logprobs=logprobs, finish_reason=out.finish_reason,
                                          stop_reason=out.stop_reason)
                usage = None
                if req.stream_options is not None and req.stream_options.continuous_usage_stats:
                    done = sum(sent_tokens.values())
                    usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=done, total_tokens=num_prompt + done)
                yield sse(CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage))
        if req.stream_options is not None and req.stream_options.include_usage:
            total = sum(sent_tokens.values())
            usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
