"""PoolingEngine: embeddings and classification scores from a pooling model, one jitted [B, S] program
per bucket compiled at start-up (0 compilations while serving); AsyncPoolingLLM: its asyncio front.

The engine's scheduler is the generate path's core Scheduler, configured for a padded-[B, S] runner
(SchedulerConfig.padded_batching): it admits prefill-only requests (Request.pooling), packs them by
length within the token budget and max_num_seqs, and finishes each in its step's update with the
pooled row. The engine only tokenizes, runs the program and post-processes.

    texts --tokenize (caller's thread)--> Request(pooling) --Scheduler.schedule--> [B, S] step
          --ModelOutput.pooled--> Scheduler.update --> rows --postprocess (Matryoshka cut, activation)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxserve.core.prefill_only import PaddedBatching, length_buckets, power_buckets
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ModelOutput, Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.stats import EngineStats
from jaxserve.pooling import model as pooling_model
from jaxserve.pooling.config import PoolingModelInfo, read_pooling_info
from jaxserve.weights.loader import resolve_dtype, resolve_model_path
from jaxserve.worker import sizing
from jaxserve.worker.programs import num_compilations

log = logging.getLogger(__name__)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
SMALLEST_SEQ_BUCKET = 16


class PoolingEngine:
    runner = "pooling"

    def __init__(self, args: EngineArgs, progress: bool = True) -> None:
        from transformers import AutoTokenizer

        if args.compilation_cache_dir:  # as LLMEngine: a restart loads its programs instead of compiling
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_enable_compilation_cache", bool(args.compilation_cache_dir))
        path = resolve_model_path(args.model)
        self.info: PoolingModelInfo = read_pooling_info(path, args.runner, args.convert, args.override_pooler_config)
        if self.info.runner != "pooling":
            raise ValueError(f"runner: {args.model} is a generative model; PoolingEngine needs --runner pooling")
        self.task = self.info.task
        self.model = pooling_model.load_pooling_model(path, resolve_dtype(args.dtype))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        limits = [self.model.max_model_len, self.info.max_seq_length, args.max_model_len]
        self.max_model_len = min(n for n in limits if n)
        self.model_name = args.served_model_name or args.model or str(path)
        self.block_size = 1
        budget = max(args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
        padded = PaddedBatching(
            seq_buckets=length_buckets(min(SMALLEST_SEQ_BUCKET, self.max_model_len), self.max_model_len),
            # Rows in powers of 4: a busy server fills its rows anyway, and each length bucket then
            # costs 3-4 programs, not 6-7 (compile time is a user's cost).
            batch_buckets=power_buckets(args.max_num_seqs, 4))
        # num_blocks is unused: the [B, S] program runs attention inside the step, no KV pool.
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=1, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=max(self.max_model_len, 2), padded_batching=padded))
        self.grid = padded.grid(args.max_num_seqs, budget)
        self._in_flight: tuple[SchedulerOutput, jax.Array] | None = None  # the step launched last
        # --dtype auto on a CPU with bfloat16 dot instructions: bfloat16 dots, as the generate runner's
        # (engine/config.py); the steps a pooling model runs are all past its 64-token threshold.
        on_cpu = jax.default_backend() == "cpu"
        self.bf16_dots = args.dtype == "auto" and sizing.default_bf16_dots_from(on_cpu) > 0
        self._fn = jax.jit(functools.partial(
            pooling_model.step, cfg=self.model.cfg, task=self.task, pooling_type=self.info.pooler.pooling_type,
            normalize=self.info.pooler.normalize, bf16_dots=self.bf16_dots))
        self._warm_up(progress)

    # ---- start-up ----
    def _warm_up(self, progress: bool) -> None:
        before = num_compilations()
        self._programs = {}
        for rows, seq in tqdm(self.grid, desc="Warm-up (compiling buckets)", unit="program", disable=not progress):
            ids = jax.ShapeDtypeStruct((rows, seq), np.int32)
            self._programs[rows, seq] = self._fn.lower(self.model.params, ids, ids,
                                                       jax.ShapeDtypeStruct((rows,), np.int32)).compile()
        self.num_warmup_compilations = num_compilations() - before
        self._compilations_at_ready = num_compilations()

    # ---- requests ----
    @property
    def num_labels(self) -> int:
        return getattr(self.model.cfg, "num_labels", 0)

    def check_length(self, token_ids: list[int], field: str = "input") -> None:
        if not token_ids:
            raise ValueError(f"{field}: an input has no tokens (an empty text without special tokens)")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{field}: this model's maximum context length is {self.max_model_len} tokens, "
                             f"but the input has {len(token_ids)} tokens; shorten it or set truncate_prompt_tokens")

    def add_request(self, request_id: str, token_ids: list[int], type_ids: list[int] | None = None) -> None:
        self.check_length(token_ids)
        self.scheduler.add_request(Request(request_id, list(token_ids), _NO_SAMPLING, time.time(), pooling=True,
                                           token_type_ids=None if type_ids is None else list(type_ids)))

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_requests([request_id])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> dict[str, np.ndarray]:
        """Launch the scheduler's next [B, S] batch, then wait for the step launched before it: the device
        runs one step while the host packs the next (one step in flight). Request id -> its raw row
        (embedding or logits), for every request of the step that finished."""
        out = self.scheduler.schedule()
        launched = (out, self._launch(out)) if out.scheduled else None
        done, self._in_flight = self._in_flight, launched
        if done is None:
            return {}
        out, rows = done
        rows = np.asarray(rows)  # waits for the device
        pooled = {sched.request_id: rows[i] for i, sched in enumerate(out.scheduled)}
        return {u.request_id: u.pooled for u in self.scheduler.update(out, ModelOutput(pooled=pooled))}

    def _launch(self, out: SchedulerOutput) -> jax.Array:
        """The step's program, dispatched (asynchronously) on its padded inputs -> rows [B, D] on the device."""
        ids = np.zeros(out.padded_shape, np.int32)
        types = np.zeros_like(ids)
        lens = np.zeros((out.padded_shape[0],), np.int32)
        for i, sched in enumerate(out.scheduled):
            n = len(sched.token_ids)
            ids[i, :n], lens[i] = sched.token_ids, n
            if sched.token_type_ids is not None:
                types[i, :n] = sched.token_type_ids
        return self._programs[out.padded_shape](self.model.params, ids, types, lens)

    def get_stats(self) -> EngineStats:
        now = num_compilations()
        return EngineStats(**dataclasses.asdict(self.scheduler.stats()), num_compilations=now,
                           num_compilations_after_warmup=now - self._compilations_at_ready)

    def startup_report(self) -> str:
        return (f"pooling model ({self.task}, {self.info.pooler.pooling_type} pooling, normalize="
                f"{self.info.pooler.normalize}{', bfloat16 dots' if self.bf16_dots else ''}): "
                f"{len(self._programs)} programs compiled at start-up")

    def run_to_completion(self, inputs: list[tuple[list[int], list[int] | None]]) -> list[np.ndarray]:
        """Offline: every input's raw row, in order."""
        ids = [f"offline-{next(_ids)}" for _ in inputs]
        for rid, (tokens, types) in zip(ids, inputs):
            self.add_request(rid, tokens, types)
        results: dict[str, np.ndarray] = {}
        while self.has_unfinished_requests():
            results.update(self.step())
        return [results[r] for r in ids]

    def shutdown(self) -> None:
        self._programs, self._in_flight = {}, None


_ids = itertools.count()
_NO_SAMPLING = SamplingParams(max_tokens=1)  # a pooling request samples nothing; the Request wants one


class AsyncPoolingLLM:
    """One background thread owns the engine; callers await futures filled from it."""

    runner = "pooling"

    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len, self.block_size = engine.max_model_len, engine.block_size
        self.model_name = engine.model_name
        self.errored = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-pooling", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncPoolingLLM":
        return cls(PoolingEngine(args))

    def startup_report(self) -> str:
        return self.engine.startup_report()

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    async def pool(self, inputs: list[tuple[list[int], list[int] | None]],
                   on_finished: Callable[[int, float], None] | None = None) -> list[np.ndarray]:
        """Each (token_ids, type_ids)'s raw row; all of them enter the scheduler at once. `on_finished`
        (the server's metrics): called with each input's prompt tokens and its seconds from arrival."""
        if self.errored:
            raise RuntimeError("the engine loop has stopped after an error")
        for tokens, _ in inputs:
            self.engine.check_length(tokens)
        loop = asyncio.get_running_loop()
        ids = [f"pool-{next(_ids)}" for _ in inputs]
        futures = [loop.create_future() for _ in inputs]
        if on_finished is not None:
            start = time.monotonic()
            for fut, (tokens, _) in zip(futures, inputs):
                fut.add_done_callback(lambda f, n=len(tokens): None if f.cancelled() or f.exception() is not None
                                      else on_finished(n, time.monotonic() - start))
        for rid, fut in zip(ids, futures):
            self._waiters[rid] = (loop, fut)
        self._inbox.put(("add", list(zip(ids, inputs))))
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for rid in ids:
                if self._waiters.pop(rid, None) is not None:
                    self._inbox.put(("abort", rid))

    def _deliver(self, rid: str, value: object) -> None:
        waiter = self._waiters.get(rid)
        if waiter is None:
            return
        loop, fut = waiter
        setter = fut.set_exception if isinstance(value, BaseException) else fut.set_result
        loop.call_soon_threadsafe(lambda: None if fut.done() else setter(value))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item[0] == "add":
                for rid, (tokens, types) in item[1]:
                    try:
                        self.engine.add_request(rid, tokens, types)
                    except ValueError as exc:
                        self._deliver(rid, exc)
            elif item[0] == "abort":
                self.engine.abort_request(item[1])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                rows = self.engine.step()
            except Exception as exc:  # noqa: BLE001  (end every waiter with the error, never hang)
                log.exception("pooling step failed")
                self.errored = True
                for rid in list(self._waiters):
                    self._deliver(rid, RuntimeError(f"the pooling step failed: {exc!r}"))
                return
            for rid, row in rows.items():
                self._deliver(rid, row)

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.engine.shutdown()
