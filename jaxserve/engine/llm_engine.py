"""LLMEngine: the synchronous core. One `step()` is

    scheduler.schedule() -> SchedulerOutput          (pure Python: who runs, which blocks)
    runner.execute(out)  -> ModelOutput              (device: one model step, one sampler call)
    scheduler.update(out, model_output) -> requests  (append tokens, stop conditions, free blocks)
    output processor     -> list[RequestOutput]      (detokenize, stop strings, logprobs, n/best_of)

A user request with n (or best_of) > 1 becomes that many scheduler Requests; the
2nd.. are forked off the 1st after its prefill, sharing its prompt blocks.
"""

from __future__ import annotations

import dataclasses
import os
import functools
import time
from typing import Iterable

import jax
import numpy as np

from jax.sharding import Mesh

from jaxserve import parallel
from jaxserve.engine import output_processor as op
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.config import EngineConfig
from jaxserve.worker.kv_sizing import needs_profile, num_device_blocks
from jaxserve.worker.model_runner import ModelRunner, activation_bytes, kv_bytes_per_block, num_compilations
from jaxserve.engine.outputs import RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.stats import EngineStats
from jaxserve.models.attention import kv_pool_dtype, kv_values_dtype
from jaxserve.models.quant import calibration_ids, quantize_params
from jaxserve.weights.loader import LoadedModel, load_model

PromptType = str | list[int] | dict


class LLMEngine:
    def __init__(self, args: EngineArgs, model: LoadedModel | None = None, progress: bool = True,
                 mesh: Mesh | None = None) -> None:
        """`mesh`: this replica's devices (axes data=1, model=tp); built from args when None."""
        t0 = time.perf_counter()
        self.args = args
        if args.compilation_cache_dir:
            # A restart with the same model and shapes then loads its programs instead of compiling.
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        if args.data_parallel_size > 1 and mesh is None:
            raise ValueError("data_parallel_size: one LLMEngine is one replica; data parallelism runs "
                             "several behind the server (`jaxserve serve --data-parallel-size N`)")
        if mesh is None and (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1):
            parallel.check_parallel_config(args.tensor_parallel_size, 1, args.pipeline_parallel_size,
                                           jax.device_count())
            mesh = parallel.make_mesh(args.tensor_parallel_size, 1)
        self.mesh = mesh
        if model is None:
            model = load_model(args.model, args.dtype, progress, mesh=mesh)
        elif mesh is not None:
            model = dataclasses.replace(model, params=parallel.shard_params(model.params, mesh, model.config))
        if args.quantization:
            ids = calibration_ids(model.tokenizer, model.config.vocab_size)
            params = quantize_params(model.params, model.config, args.quantization, ids)
            model = dataclasses.replace(model, params=params)
        self.model = model
        cfg = self.model.config
        self.tokenizer = self.model.tokenizer
        if args.chat_template and self.tokenizer is not None:
            self.tokenizer.chat_template = _read_template(args.chat_template)
        self.model_name = args.served_model_name or self.model.name
        self.config = self._size_kv(EngineConfig.resolve(args, cfg.max_position_embeddings, jax.default_backend()),
                                    mesh)
        self.max_model_len = self.config.max_model_len
        self.num_gpu_blocks, self.num_cpu_blocks = self.config.num_gpu_blocks, self.config.num_cpu_blocks
        self.scheduler = Scheduler(self.config.scheduler_config())
        self.runner = ModelRunner(self.model, self.config.runner_config(), mesh)
        self.load_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.runner.warmup(progress)
        self.warmup_seconds = time.perf_counter() - t1
        self.compilations_at_warmup = num_compilations()
        self._rng = np.random.default_rng(args.seed)
        self._groups: dict[str, op.RequestGroup] = {}
        self._child: dict[str, tuple[op.RequestGroup, op.SampleState]] = {}
        self._seeds: dict[str, int] = {}
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    def _size_kv(self, config: EngineConfig, mesh: Mesh | None) -> EngineConfig:
        """`config` with its KV pools sized: the device blocks from the memory left (after a profiling run
        on an accelerator), the host swap blocks from swap_space."""
        args = config.args
        kv_dtype = kv_pool_dtype(args.kv_cache_dtype, self.model.params["embed"].dtype, config.attention_backend)
        per_block = kv_bytes_per_block(self.model.config, args.block_size, kv_dtype, mesh)
        # What one device holds: its shard of each weight.
        weight_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.model.params))
        self.activation_bytes = (activation_bytes(self.model, config.with_blocks(config.min_blocks + 1).runner_config())
                                 if needs_profile(args) else 0)
        num_gpu = num_device_blocks(args, per_block, weight_bytes, self.activation_bytes, config.min_blocks)
        num_cpu = int(args.swap_space * (1 << 30)) // per_block if args.preemption_mode == "swap" else 0
        return config.with_blocks(num_gpu, num_cpu)

    # ---- requests -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")

    @functools.cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model config's end-of-sequence ids plus the tokenizer's (a chat model's end-of-turn)."""
        eos = tuple(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = tuple(dict.fromkeys(eos + (self.tokenizer.eos_token_id,)))
        return eos

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for anything add_request would refuse; safe to call from any thread."""
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is out of range for a vocabulary of {vocab}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens, but this model's maximum context length is "
                             f"{self.max_model_len} (prompt plus at least one generated token)")
        if params.use_beam_search:
            raise ValueError("use_beam_search: beam search is not supported yet; use n/best_of sampling")
        if params.best_of > self.args.max_num_seqs:
            field = "best_of" if params.best_of > params.n else "n"
            raise ValueError(f"{field}: {params.best_of} parallel samples exceed max_num_seqs "
                             f"({self.args.max_num_seqs}), so they could never run together")
        bad_bias = next((t for t in (params.logit_bias or {}) if not 0 <= t < vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias: token id {bad_bias} is out of range for a vocabulary of {vocab}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text, token_ids = self.encode_prompt(prompt)
        self.validate(token_ids, params)
        eos = self.eos_token_ids
        params = dataclasses.replace(params, eos_token_ids=eos)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        child_ids = [request_id] if params.best_of == 1 else [f"{request_id}#{i}" for i in range(params.best_of)]
        group = op.new_group(request_id, text, token_ids, params, child_ids, self.tokenizer, arrival)
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        for i, sample in enumerate(group.samples):
            req = Request(sample.child_id, list(token_ids), params, arrival, eos_token_ids=eos,
                          parent_id=child_ids[0] if i else None)
            self.scheduler.add_request(req)
            self._seeds[sample.child_id] = base_seed + i
            self._child[sample.child_id] = (group, sample)
        self._groups[request_id] = group

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            self.scheduler.abort_requests([s.child_id for s in group.samples])
            for s in group.samples:
                op.finish(s, "abort")
                self._forget(s.child_id)
            outputs.append(op.make_output(group))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self.scheduler.has_unfinished_requests()

    has_unfinished = has_unfinished_requests  # the short name the engine issue uses

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: bool = True) -> "LLMEngine":
        return cls(args, progress=progress)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        now = time.monotonic()
        for sr in out.scheduled:
            group, _ = self._child[sr.request_id]
            group.metrics.first_scheduled_time = group.metrics.first_scheduled_time or now
            prompt_len = len(group.prompt_token_ids)
            self._num_prompt_tokens += max(0, min(sr.start_pos + len(sr.token_ids), prompt_len) - sr.start_pos)
        requests = {sr.request_id: self.scheduler.get_request(sr.request_id) for sr in out.scheduled}
        model_out = self.runner.execute(out, requests, self._seeds)
        updated = self.scheduler.update(out, model_out)
        now = time.monotonic()
        for rid, entries in model_out.prompt_logprobs.items():
            group, _ = self._child[rid]
            op.absorb_prompt_logprobs(group, entries, self.tokenizer)
        changed: dict[str, op.RequestGroup] = {}
        cached: dict[str, int] = {}
        for req in updated:
            group, sample = self._child[req.request_id]
            before = len(sample.token_ids)
            first = model_out.sampled.get(req.request_id)
            sampled = [first, *model_out.draft_sampled.get(req.request_id, ())] if first is not None else []
            stop_hit = op.absorb(group, sample, req, sampled, self.tokenizer, now)
            self._num_generation_tokens += len(sample.token_ids) - before
            if stop_hit is not None and not req.is_finished:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            changed[group.request_id] = group
            cached[group.request_id] = max(cached.get(group.request_id, 0), req.num_cached_tokens)
        outputs = []
        for rid, group in changed.items():
            outputs.append(op.make_output(group, cached[rid]))
            if group.finished:
                del self._groups[rid]
                for s in group.samples:
                    self._forget(s.child_id)
        return outputs

    def _forget(self, child_id: str) -> None:
        self._child.pop(child_id, None)
        self._seeds.pop(child_id, None)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        compiles = num_compilations()
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_swapped=s.num_swapped,
            kv_cache_usage=s.kv_cache_usage, cpu_cache_usage=s.cpu_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, spec_num_drafts=s.spec_num_drafts,
            spec_num_draft_tokens=s.spec_num_draft_tokens, spec_num_accepted_tokens=s.spec_num_accepted_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens, num_compilations=compiles,
            num_compilations_after_warmup=compiles - self.compilations_at_warmup,
            num_gpu_blocks=self.num_gpu_blocks, num_cpu_blocks=self.num_cpu_blocks)

    def startup_report(self) -> str:
        per_req = -(-self.max_model_len // self.args.block_size)
        kv_values = kv_values_dtype(self.args.kv_cache_dtype, self.model.params["embed"].dtype).name
        sharding = ("" if self.mesh is None else
                    "\n" + parallel.sharding_summary(self.mesh, self.model.config, self.model.params, self.runner.kv))
        return sharding + (f"model {self.model_name} ({self.model.config.architecture}, {self.model.config.num_layers} layers) "
                f"loaded in {self.load_seconds:.1f}s; KV pool: {self.num_gpu_blocks} blocks of "
                f"{self.args.block_size} tokens ({self.num_gpu_blocks * self.args.block_size} tokens, {kv_values}), max "
                f"concurrency at max_model_len={self.max_model_len}: {self.num_gpu_blocks / per_req:.1f}x; "
                f"swap blocks: {self.num_cpu_blocks}; warm-up compiled in {self.warmup_seconds:.1f}s")


def _read_template(value: str) -> str:
    from pathlib import Path

    p = Path(value)
    return p.read_text() if p.is_file() else value
