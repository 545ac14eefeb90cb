"""AsyncLLM: the asyncio front of LLMEngine for the HTTP server.

The engine loop runs in one background thread and owns the engine outright;
asyncio callers talk to it only through a thread-safe inbox (add / abort) and
get results through per-request asyncio queues filled with
`loop.call_soon_threadsafe`. So the scheduler never sees two threads, and a slow
step never blocks the event loop.

    generate() --validate--> inbox ---> [engine thread: drain inbox, step()] ---> queue --> yield

Failures (engine/exceptions.py): a step that raises RequestFailedError ends that request alone;
any other exception kills the loop: every open request ends with EngineDeadError, `errored` turns
True and later requests are refused at once (the server then answers 503 and exits non-zero).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import fields

from jaxserve.engine import beam_search
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.data_parallel import replica_engines
from jaxserve.engine.exceptions import EngineDeadError, RequestAbortedError, RequestFailedError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.async_sleep import AsyncSleepMixin, DataParallelSleepMixin
from jaxserve.engine.weight_sync import AsyncWeightSync, DataParallelWeightSync
from jaxserve.pooling.outputs import PoolingRequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.stats import EngineStats
from jaxserve.lora.manager import ReplicatedLoRAManager
from jaxserve.weights.loader import LoadedModel

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05


class AsyncLLM(AsyncSleepMixin, AsyncWeightSync):  # sleep, wake_up, pause_generation, resume_generation
    # (engine/sleep.py); update_weights, update_weights_from_disk, reset_prefix_cache (engine/weight_sync.py)
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len, self.block_size = engine.max_model_len, engine.block_size
        self.model_name = engine.model_name
        self.runner_kind, self.core_engine = engine.runner_kind, engine  # "generate" | "pooling"; its facts
        # what the server reads besides: every name a request may use, the generation config's
        # defaults for the fields a request leaves unset, --max-logprobs
        self.served_model_names = engine.served_model_names
        self.default_sampling_params, self.max_logprobs = engine.default_sampling_params, engine.args.max_logprobs
        self.dead_error: EngineDeadError | None = None
        self._lock = threading.Lock()  # orders stream registration against the loop's death
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._queued: set[str] = set()  # (event loop's thread) requests without an output yet
        self._extra_seqs: dict[str, int] = {}  # (event loop's thread) best_of - 1 of requests sampling several
        self.max_num_seqs = engine.args.max_num_seqs
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stats = engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs):
        """One engine, or with --data-parallel-size > 1 a DataParallelAsyncLLM of replicas."""
        if args.data_parallel_size > 1:
            return DataParallelAsyncLLM.from_engine_args(args)
        return cls(LLMEngine(args))

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def lora_manager(self):
        """The engine's LoRAManager (None without --enable-lora): the server resolves `model` names with it."""
        return self.engine.lora

    def startup_report(self) -> str:
        return self.engine.startup_report()

    async def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams, request_id: str,
                       *, prompt_logprobs: bool = False, lora_request=None) -> AsyncIterator[RequestOutput]:
        if self.dead_error is not None:
            raise self.dead_error
        if sampling_params.use_beam_search:
            async for out in self._beam_search(prompt, sampling_params, request_id):
                yield out
            return
        text, token_ids = self.engine.encode_prompt(prompt)
        processor, mm = getattr(self.engine, "mm_processor", None), None  # (an encoder's engine has none)
        if processor is not None and isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # images: decoded and resized by the checkpoint's processor off the event loop
            token_ids, mm = await asyncio.to_thread(processor.apply, prompt, token_ids)
        elif processor is not None:
            token_ids, mm = processor.apply(prompt, token_ids)  # text: checked for stray image placeholders
        self.engine.validate(token_ids, sampling_params)
        self.engine.check_has_weights()  # dropped by sleep(level=2) and not replaced: an error, not a wait
        self.engine.check_lora(lora_request)  # reads the adapter here, not on the engine thread
        q = self._open_stream(request_id)
        if (sampling_params.best_of or 1) > 1:  # each sample takes a running slot
            self._extra_seqs[request_id] = sampling_params.best_of - 1
        self._post(("add", request_id, {"prompt": text, "prompt_token_ids": token_ids, "mm_inputs": mm},
                    sampling_params, lora_request))
        finished = False
        try:
            while not finished:
                item = await q.get()
                self._queued.discard(request_id)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (disconnect, cancel): free the request's blocks
                self._post(("abort", request_id))
            self._streams.pop(request_id, None)
            self._queued.discard(request_id)
            self._extra_seqs.pop(request_id, None)

    async def encode(self, prompt_token_ids: list[int], request_id: str, *,
                     token_type_ids: list[int] | None = None) -> PoolingRequestOutput:
        """A pooling model's result for one tokenized input (vLLM's AsyncLLM.encode): its embedding or
        classifier logits, batched by the scheduler with every request in flight. The same guarantees
        as generate(): a dead engine raises EngineDeadError, an abort (or shutdown) ends it with
        RequestAbortedError, a cancelled caller aborts it."""
        if self.dead_error is not None:
            raise self.dead_error
        self.engine.check_pooling_input(prompt_token_ids)
        q = self._open_stream(request_id)
        self._post(("pool", request_id, list(prompt_token_ids), token_type_ids))
        finished = False
        try:
            item = await q.get()
            finished = True
            if isinstance(item, BaseException):
                raise item
            if item.aborted:
                raise RequestAbortedError(request_id)
            return item
        finally:
            if not finished:  # the caller went away (disconnect, cancel): drop the request
                self._post(("abort", request_id))
            self._streams.pop(request_id, None)
            self._queued.discard(request_id)

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        """The request's output queue, registered (no await before the request is posted, so a burst's
        next request counts it)."""
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:  # after the loop's death no stream is registered, so none waits forever
            if self.dead_error is not None:
                raise self.dead_error
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._queued.add(request_id)
        return q

    async def _beam_search(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Rounds of one-token requests per live beam (see beam_search.py); one final output."""
        text, ids = self.engine.encode_prompt(prompt)
        beam_search.check(params, self.max_logprobs)
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

    def abort_all(self) -> None:
        """End every request now with finish_reason "abort" (graceful shutdown); thread-safe."""
        self._post(("abort_all",))

    def num_unfinished(self) -> int:
        return len(self._streams)

    def num_queued(self) -> int:
        """Requests accepted that have no output yet (waiting to be scheduled, or in their prefill)."""
        return len(self._queued)

    def num_waiting_beyond_capacity(self) -> int:
        """Sequences accepted and unfinished beyond what the running slots (--max-num-seqs) take: what
        --max-num-queued-reqs bounds. Counted here at the front, not from the engine's last step, so
        each request of a burst sees the ones before it (a request sampling n takes n slots)."""
        return max(0, len(self._streams) + sum(self._extra_seqs.values()) - self.max_num_seqs)

    def get_stats(self) -> EngineStats:
        return self._stats

    def shutdown(self) -> None:
        """Stop the engine thread, then release the engine (its pool, programs and weights)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # (a thread stuck in a step still uses the engine)
            self.engine.shutdown()

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
            if msg[0] in ("add", "pool"):
                rid = msg[1]
                try:
                    if msg[0] == "pool":
                        self.engine.add_pooling_request(rid, msg[2], msg[3])
                    else:
                        self.engine.add_request(rid, msg[2], msg[3], lora_request=msg[4])
                except ValueError as e:
                    self._deliver(rid, e)
                except Exception as e:  # noqa: BLE001  (this request's own input failed: it alone ends)
                    log.exception("request %s failed when added", rid)
                    self.engine.abort_request(rid)  # whatever part of it was registered
                    self._deliver(rid, RequestFailedError(rid, f"request failed: {type(e).__name__}"))
            else:
                ids = [msg[1]] if msg[0] == "abort" else self.engine.request_ids()
                for out in self.engine.abort_request(ids):
                    self._deliver(out.request_id, out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RequestFailedError as e:  # the step knew whose input failed it: end that request alone
            log.error("request %s failed a step: %s", e.request_id, e)
            self.engine.abort_request(e.request_id)
            self._deliver(e.request_id, e)
            return
        for out in outputs:
            self._deliver(out.request_id, out)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                self._run_controls()  # sleep, wake_up, pause, resume: between steps
                if self.engine.can_step():  # (paused or asleep: the requests wait)
                    self._step()
                    self._stats = self.engine.get_stats()
                else:
                    self._stats = self.engine.get_stats()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
        except Exception as e:  # a bug or a device failure: fail every open request, refuse new ones
            log.exception("engine loop failed; the engine is dead")
            with self._lock:
                self.dead_error = EngineDeadError(f"The engine has stopped after an error ({type(e).__name__}); "
                                                  "the server is shutting down")
                for rid in list(self._streams):
                    self._deliver(rid, self.dead_error)
        self._fail_controls()  # stopped or dead: no sleep/pause call waits forever


# ---- data parallelism: M replicas (engine/data_parallel.py builds their engines) behind one front ----
class DataParallelAsyncLLM(DataParallelSleepMixin, DataParallelWeightSync):
    def __init__(self, replicas: list[AsyncLLM]) -> None:
        self.replicas = replicas
        first = replicas[0]
        self.tokenizer, self.max_model_len, self.model_name = first.tokenizer, first.max_model_len, first.model_name
        self.block_size = first.block_size
        self.runner_kind, self.core_engine = first.runner_kind, first.core_engine
        self.served_model_names = first.served_model_names
        self.default_sampling_params, self.max_logprobs = first.default_sampling_params, first.max_logprobs
        self.in_flight = [0] * len(replicas)
        self.num_served = [0] * len(replicas)  # requests each replica has taken, for logs and tests
        self._owner: dict[str, int] = {}
        # LoRA: a name (--lora-modules, /v1/load_lora_adapter) is served by every replica under one id,
        # so a request naming it runs under the same adapter whichever replica takes it
        managers = [r.lora_manager for r in replicas]
        self.lora_manager = ReplicatedLoRAManager(managers) if all(m is not None for m in managers) else None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, model: LoadedModel | None = None,
                         progress: bool = True) -> "DataParallelAsyncLLM":
        return cls([AsyncLLM(e) for e in replica_engines(args, model, progress)])

    @property
    def errored(self) -> bool:
        return any(r.errored for r in self.replicas)

    def startup_report(self) -> str:
        return "\n".join(f"replica {i}: {r.startup_report()}" for i, r in enumerate(self.replicas))

    async def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams, request_id: str,
                       *, prompt_logprobs: bool = False, lora_request=None) -> AsyncIterator[RequestOutput]:
        i = self._pick(request_id)
        try:
            async for out in self.replicas[i].generate(prompt, sampling_params, request_id, lora_request=lora_request):
                yield out
        finally:
            self.in_flight[i] -= 1
            self._owner.pop(request_id, None)

    async def encode(self, prompt_token_ids: list[int], request_id: str, *,
                     token_type_ids: list[int] | None = None) -> PoolingRequestOutput:
        i = self._pick(request_id)
        try:
            return await self.replicas[i].encode(prompt_token_ids, request_id, token_type_ids=token_type_ids)
        finally:
            self.in_flight[i] -= 1
            self._owner.pop(request_id, None)

    def _pick(self, request_id: str) -> int:
        """The replica with the fewest requests in flight (then the fewest served) takes the request."""
        i = min(range(len(self.replicas)), key=lambda k: (self.in_flight[k], self.num_served[k]))
        self.in_flight[i] += 1
        self.num_served[i] += 1
        self._owner[request_id] = i
        return i

    async def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()

    def num_queued(self) -> int:
        return sum(r.num_queued() for r in self.replicas)

    def num_waiting_beyond_capacity(self) -> int:
        """What waits beyond each replica's own slots, summed (a free slot on one replica does not run
        another's queue, but the router sends new requests to the least loaded)."""
        return sum(r.num_waiting_beyond_capacity() for r in self.replicas)

    def get_stats(self) -> EngineStats:
        """Counts and counters summed over replicas; cache usage averaged, weighted by pool size."""
        stats = [r.get_stats() for r in self.replicas]
        total = {}
        for f in fields(EngineStats):
            values = [getattr(s, f.name) for s in stats]  # names (the LoRA adapters): their union
            total[f.name] = tuple(sorted(set().union(*values))) if isinstance(values[0], tuple) else sum(values)
        total["max_lora"] = stats[0].max_lora  # slots of one replica, as vLLM's label
        for name, blocks in (("kv_cache_usage", "num_gpu_blocks"), ("cpu_cache_usage", "num_cpu_blocks")):
            weight = sum(getattr(s, blocks) for s in stats)
            total[name] = sum(getattr(s, name) * getattr(s, blocks) for s in stats) / weight if weight else 0.0
        # Compilations are counted per process, and every replica sees the same counter.
        total["num_compilations"] = stats[0].num_compilations
        total["num_compilations_after_warmup"] = max(s.num_compilations_after_warmup for s in stats)
        return EngineStats(**total)

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()
