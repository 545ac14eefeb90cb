"""AsyncLLM: the asyncio front of LLMEngine for the HTTP server.

The engine loop runs in one background thread and owns the engine outright;
asyncio callers talk to it only through a thread-safe inbox (add / abort) and
get results through per-request asyncio queues filled with
`loop.call_soon_threadsafe`. So the scheduler never sees two threads, and a slow
step never blocks the event loop.

    generate() --validate--> inbox ---> [engine thread: drain inbox, step()] ---> queue --> yield
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator

from jaxserve.engine import beam_search
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.stats import EngineStats

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len, self.block_size = engine.max_model_len, engine.block_size
        self.model_name = engine.model_name
        self.errored = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stats = engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs):
        """One engine, or with --data-parallel-size > 1 a DataParallelAsyncLLM of replicas."""
        if args.data_parallel_size > 1:
            from jaxserve.engine.data_parallel import DataParallelAsyncLLM

            return DataParallelAsyncLLM.from_engine_args(args)
        return cls(LLMEngine(args))

    @property
    def lora_manager(self):
        """The engine's LoRAManager (None without --enable-lora): the server resolves `model` names with it."""
        return self.engine.lora

    def startup_report(self) -> str:
        return self.engine.startup_report()

    async def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams, request_id: str,
                       *, prompt_logprobs: bool = False, lora_request=None) -> AsyncIterator[RequestOutput]:
        if self.errored:
            raise RuntimeError("the engine loop has stopped after an error")
        if sampling_params.use_beam_search:
            async for out in self._beam_search(prompt, sampling_params, request_id):
                yield out
            return
        text, token_ids = self.engine.encode_prompt(prompt)
        self.engine.validate(token_ids, sampling_params)
        self.engine.check_lora(lora_request)  # reads the adapter here, not on the engine thread
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._post(("add", request_id, {"prompt": text, "prompt_token_ids": token_ids}, sampling_params,
                    lora_request))
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (disconnect, cancel): free the request's blocks
                self._post(("abort", request_id))
            self._streams.pop(request_id, None)

    async def _beam_search(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Rounds of one-token requests per live beam (see beam_search.py); one final output."""
        text, ids = self.engine.encode_prompt(prompt)
        beam_search.check(params)
        self.engine.validate(ids, dataclasses.replace(params, use_beam_search=False))
        step = beam_search.step_params(params, beam_search.width_of(params))
        search = beam_search.search(ids, params, self.max_model_len, self.engine.eos_token_ids)

        async def one(tokens: list[int], name: str) -> list[tuple[int, float]]:
            final = None
            async for out in self.generate(tokens, step, name):
                final = out
            return beam_search.candidates_from(final)

        rnd, candidates = 0, None
        while True:
            try:
                prompts = search.send(candidates)
            except StopIteration as stop:
                beams = stop.value
                break
            candidates = await asyncio.gather(*(one(t, f"{request_id}-beam{rnd}.{k}") for k, t in enumerate(prompts)))
            rnd += 1
        tok = self.tokenizer
        decode = (lambda t: tok.decode(t, skip_special_tokens=True)) if tok is not None else (lambda t: "")
        yield beam_search.to_output(request_id, text, ids, beams, decode)

    async def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def get_stats(self) -> EngineStats:
        return self._stats

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- engine thread ----------------------------------------------------------------------------
    def _post(self, msg: tuple) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params, lora_request = msg
                try:
                    self.engine.add_request(rid, prompt, params, lora_request=lora_request)
                except ValueError as e:
                    self._deliver(rid, e)
            else:
                self.engine.abort_request(msg[1])

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                    self._stats = self.engine.get_stats()
                else:
                    self._stats = self.engine.get_stats()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
        except Exception as e:  # a bug or a device failure: fail every open request, keep the server up
            log.exception("engine loop failed")
            self.errored = True
            for rid in list(self._streams):
                self._deliver(rid, RuntimeError(f"engine failed: {e}"))
