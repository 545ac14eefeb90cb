"""A fake `AsyncLLM` whose outputs are computable by hand, for testing the HTTP layer without weights.

The tokenizer is a 128-word WordLevel vocabulary built with `tokenizers`:

    0 <pad>  1 <s>  2 </s> (eos)  3 <unk>  4 system  5 user  6 assistant  7 hello  8 world  9.. w0..w118

Rule: output k of a request generates, at step j, token `(last prompt token + 1 + k + j) % 128`,
one token per step for every output, with logprob -0.5 (rank 1) and top-N alternatives
`token + r` at logprob -0.5 * (r + 1). So prompt "w10" (id 19) yields "w11 w12 w13 ...".
The eos token (2) ends an output with "stop" unless ignore_eos or before min_tokens.

Prompts containing `fail_token` raise ValueError before the first yield (as the real
engine does for bad input); prompts containing `crash_token` raise RuntimeError mid-stream.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from starlette.types import ASGIApp

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.stats import EngineStats

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "system", "user", "assistant", "hello", "world"]
WORDS += [f"w{i}" for i in range(128 - len(WORDS))]
EOS_ID = 2
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant{% endif %}")


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", chat_template=CHAT_TEMPLATE)


def expected_ids(prompt_last: int, num_tokens: int, k: int = 0) -> list[int]:
    return [(prompt_last + 1 + k + j) % len(WORDS) for j in range(num_tokens)]


@dataclass
class _Sequence:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class FakeAsyncLLM:
    def __init__(self, *, max_model_len: int = 64, model_name: str = "fake-model", step_delay: float = 0.0,
                 num_gpu_blocks: int = 64, block_size: int = 16, fail_token: str = "w100",
                 crash_token: str | None = "w101") -> None:
        self.tokenizer = build_tokenizer()
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.step_delay = step_delay
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.fail_id = WORDS.index(fail_token)
        self.crash_id = None if crash_token is None else WORDS.index(crash_token)
        self.running: dict[str, int] = {}  # request id -> tokens held in "KV blocks"
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.is_shut_down = False
        self.queued: set[str] = set()  # requests without an output yet
        self._abort_all = False  # set by abort_all(): every running request ends with "abort"

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str,
                       *, prompt_logprobs: bool = False) -> AsyncIterator[RequestOutput]:
        prompt_ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt length {len(prompt_ids)} is >= max_model_len {self.max_model_len}")
        if self.fail_id in prompt_ids:
            raise ValueError("prompt contains the fake engine's fail token")
        params = sampling_params
        metrics = RequestMetrics(arrival_time=time.monotonic())
        sequences = [_Sequence() for _ in range(params.best_of or params.n)]
        self.running[request_id] = len(prompt_ids)
        self.num_prompt_tokens += len(prompt_ids)
        self.queued.add(request_id)
        done = False
        try:
            await asyncio.sleep(self.step_delay)
            self.queued.discard(request_id)
            metrics.first_scheduled_time = time.monotonic()
            step = 0
            while not all(s.finish_reason for s in sequences):
                if self._abort_all:
                    for seq in sequences:
                        seq.finish_reason = seq.finish_reason or "abort"
                    self.running.pop(request_id, None)
                    self.aborted.append(request_id)
                    done = True
                    yield self._output(request_id, prompt, prompt_ids, sequences, params, metrics, True,
                                       prompt_logprobs)
                    return
                if step == 1 and self.crash_id is not None and self.crash_id in prompt_ids:
                    raise RuntimeError("the fake engine crashed")
                for k, seq in enumerate(sequences):
                    if seq.finish_reason is None:
                        self._advance(seq, prompt_ids[-1], k, params)
                        self.num_generation_tokens += 1
                        self.running[request_id] += 1
                now = time.monotonic()
                metrics.token_times.append(now)
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                step += 1
                finished = all(s.finish_reason for s in sequences)
                if finished:
                    metrics.finished_time = now
                    done = True
                    self.finished.append(request_id)
                    self.running.pop(request_id, None)
                yield self._output(request_id, prompt, prompt_ids, sequences, params, metrics, finished,
                                   prompt_logprobs)
                if not finished:
                    await asyncio.sleep(self.step_delay)
        finally:
            self.queued.discard(request_id)
            if not done:
                await self.abort(request_id)

    def _advance(self, seq: _Sequence, prompt_last: int, k: int, params: SamplingParams) -> None:
        token = (prompt_last + 1 + k + len(seq.token_ids)) % len(WORDS)
        seq.token_ids.append(token)
        num_top = max(params.logprobs or 0, 1)
        seq.logprobs.append({(token + r) % len(WORDS): Logprob(-0.5 * (r + 1), r + 1, WORDS[(token + r) % len(WORDS)])
                             for r in range(num_top)})
        seq.text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=params.skip_special_tokens)
        may_stop = len(seq.token_ids) > params.min_tokens
        if may_stop and token == EOS_ID and not params.ignore_eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif may_stop and token in (params.stop_token_ids or []):
            seq.finish_reason, seq.stop_reason = "stop", token
        elif may_stop and any(s in seq.text for s in params.stop or []):
            stop = min((s for s in params.stop or [] if s in seq.text), key=seq.text.index)
            end = seq.text.index(stop) + (len(stop) if params.include_stop_str_in_output else 0)
            seq.text = seq.text[:end].rstrip() if not params.include_stop_str_in_output else seq.text[:end]
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif params.max_tokens is not None and len(seq.token_ids) >= params.max_tokens:
            seq.finish_reason = "length"

    def _output(self, request_id: str, prompt: str | list[int], prompt_ids: list[int], sequences: list[_Sequence],
                params: SamplingParams, metrics: RequestMetrics, finished: bool,
                prompt_logprobs: bool) -> RequestOutput:
        outputs = [CompletionOutput(index=k, text=s.text, token_ids=list(s.token_ids),
                                    cumulative_logprob=-0.5 * len(s.token_ids),
                                    logprobs=list(s.logprobs) if params.logprobs is not None else None,
                                    finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                   for k, s in enumerate(sequences[:params.n])]
        prompt_lps = None
        if prompt_logprobs:
            prompt_lps = [None] + [{t: Logprob(-1.0, 1, WORDS[t])} for t in prompt_ids[1:]]
        return RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                             prompt_token_ids=prompt_ids, outputs=outputs, finished=finished,
                             prompt_logprobs=prompt_lps, metrics=metrics)

    async def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def abort_all(self) -> None:
        self._abort_all = True

    def num_queued(self) -> int:
        return len(self.queued)

    def num_waiting_beyond_capacity(self) -> int:
        """The fake has no running slots of its own: every request without an output yet waits."""
        return len(self.queued)

    def get_stats(self) -> EngineStats:
        capacity = self.num_gpu_blocks * self.block_size
        used = sum(self.running.values())
        return EngineStats(num_running=len(self.running), kv_cache_usage=min(used / capacity, 1.0),
                           num_prompt_tokens=self.num_prompt_tokens,
                           num_generation_tokens=self.num_generation_tokens, num_compilations=3,
                           num_gpu_blocks=self.num_gpu_blocks)

    def shutdown(self) -> None:
        self.is_shut_down = True


@contextmanager
def serve_in_thread(app: ASGIApp) -> Iterator[str]:
    """A real uvicorn server for `app` on 127.0.0.1 (a free port) in a background thread; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
