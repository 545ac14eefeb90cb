"""LLMEngine: the synchronous core. One `step()` is

    scheduler.schedule() -> SchedulerOutput                  (pure Python: who runs, which blocks, sampling inputs)
    runner.execute(out)  -> ModelOutput                      (device: one model step, one sampler call)
    scheduler.update(out, model_output) -> [RequestUpdate]   (accepted tokens, stop conditions, free blocks)
    outputs.process(...) -> [RequestOutput]                  (detokenize, stop strings, logprobs, n/best_of)

A user request with n (or best_of) > 1 becomes that many scheduler Requests (seeds
seed, seed + 1, ...); the 2nd.. are forked off the 1st after its prefill, sharing its
prompt blocks. The output processor gathers them back into one RequestOutput.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import functools
import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh

from jaxserve import parallel
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine import pooling
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.config import EngineConfig, default_bf16_dots_from
from jaxserve.engine.generation_config import generation_defaults
from jaxserve.quantization import gguf_packed
from jaxserve.worker import sizing
from jaxserve.worker.kv_groups import kv_layout
from jaxserve.worker.kv_sizing import kv_bytes_per_block, needs_profile, num_device_blocks, refuse_oversized_weights
from jaxserve.worker.model_runner import ModelRunner, PendingStep, activation_bytes, num_compilations
from jaxserve.engine.outputs import RequestOutput
from jaxserve.pooling.outputs import PoolingRequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import ModelOutput, SchedulerOutput
from jaxserve.core.structured_output import StructuredOutputManager, validate_structured_outputs
from jaxserve.engine.stats import EngineStats
from jaxserve.engine.weight_sync import WeightSync
from jaxserve.engine.sleep import SleepMixin
from jaxserve.models import registry
from jaxserve.models.attention import kv_pool_dtype, kv_values_dtype, resolve_backend
from jaxserve.models.config import with_expert_parallel
from jaxserve.models.longrope import for_max_model_len
from jaxserve.quantization.quantize import ON_LOAD_METHODS, calibration_ids, quantize_params
from jaxserve.weights import expert_bits
from jaxserve.weights.loader import LoadedModel, load_model, load_tokenizer, resolve_dtype
from jaxserve.weights.source import describe_model
from jaxserve.lora.manager import LoRAManager, check_lora_model
from jaxserve.lora.request import LoRARequest
from jaxserve.multimodal.processor import processor_for, refuse_unless_images

PromptType = str | list[int] | dict
log = logging.getLogger(__name__)


class LLMEngine(pooling.PoolingRequests, WeightSync, SleepMixin):  # WeightSync: get_weights, update_weights (RL);
    # SleepMixin: sleep, wake_up, pause_generation, resume_generation (engine/sleep.py)
    def __init__(self, args: EngineArgs, model: LoadedModel | None = None, progress: bool = True,
                 mesh: Mesh | None = None, devices: Sequence[jax.Device] | None = None) -> None:
        """`mesh`: this replica's devices (axes data=1, model=tp); built from args when None.
        `devices`: with pipeline stages, this replica's tp x pp devices; the first ones when None."""
        t0 = time.perf_counter()
        self.args = args
        if args.trust_remote_code:
            log.info("trust_remote_code: accepted for vLLM's commands; jaxserve never runs a model's or a "
                     "tokenizer's remote code (every architecture it serves is its own)")
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None  # a bad one fails before loading
        if args.compilation_cache_dir:
            # A restart with the same model and shapes then loads its programs instead of compiling.
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        # "" turns it off for this engine's compiles (the setting is process-wide).
        jax.config.update("jax_enable_compilation_cache", bool(args.compilation_cache_dir))
        if args.data_parallel_size > 1 and mesh is None and devices is None:
            raise ValueError("data_parallel_size: one LLMEngine is one replica; data parallelism runs "
                             "several behind the server (`jaxserve serve --data-parallel-size N`)")
        if mesh is None and devices is None and (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1):
            parallel.check_parallel_config(args.tensor_parallel_size, 1, args.pipeline_parallel_size,
                                           jax.device_count())
            # Pipeline stages get a sub-mesh each (parallel/pipeline.py) instead of one mesh.
            mesh = parallel.make_mesh(args.tensor_parallel_size, 1) if args.pipeline_parallel_size == 1 else None
        self.mesh = mesh
        # The runner kind (vLLM's --runner): a pooling model is this engine with a runner that returns
        # pooled rows (engine/pooling.py), read from the model directory before any weight.
        self.pooling_info = pooling.pooling_info(args, model.path if model is not None else None)
        self.pooler: pooling.Pooler | None = None
        if self.pooling_info is not None:
            encoder = pooling.is_encoder(self.pooling_info)
            pooling.refuse_flags(args, encoder)
            if encoder:
                self._init_encoder(pooling.EncoderParts.build(args, self.pooling_info, mesh), progress)
                return
            args = self.args = pooling.pooling_args(args, self.pooling_info,
                                                    describe_model(args.model).config.max_position_embeddings)
        # Weights the engine loaded itself are deleted on shutdown. A LoadedModel passed in may serve
        # other engines too, and what the engine derives from it (its shards, a quantized or staged
        # copy) may share buffers with it (device_put reuses a buffer already on the device): those
        # are only dropped, for the collector to free what nothing else holds.
        self._owns_weights = model is None
        bf16_experts = expert_bits.keeps_bf16_experts(default_bf16_dots_from(args, jax.default_backend()),
                                                      args.attention_backend)
        if model is None:
            source = describe_model(args.model)  # what the model is, before reading any weight
            if args.enable_lora:
                check_lora_model(source.config)
            registry.refuse_flags(source.config, args, source.quantization)  # a family's unsupported flags
            refuse_unless_images(source.config, args)  # the multimodal flags, for a text-only model
            if jax.default_backend() != "cpu":  # refuse what cannot fit before loading it
                width = jnp.dtype(resolve_dtype(args.dtype)).itemsize
                refuse_oversized_weights(
                    source.config, width,
                    tensor_parallel_size=args.tensor_parallel_size,
                    pipeline_parallel_size=args.pipeline_parallel_size, quantization=args.quantization,
                    max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                    enable_chunked_prefill=args.enable_chunked_prefill, max_num_seqs=args.max_num_seqs,
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    lora_bytes=_lora_bytes(args, source.config, width, args.tensor_parallel_size))
            model = load_model(source, args.dtype, progress, mesh=mesh, quantization=args.quantization,
                               expert_parallel=args.enable_expert_parallel, expert_bits=bf16_experts)
        else:
            if args.enable_lora:
                check_lora_model(model.config)
            registry.refuse_flags(model.config, args, model.quantization)
            if args.quantization == "gguf" and model.quantization != "gguf":  # its blocks are gone once loaded
                raise ValueError("quantization: 'gguf' is applied while the engine loads a .gguf file; pass the "
                                 "model's path, not a model already loaded")
            model = dataclasses.replace(model, config=with_expert_parallel(model.config, args.enable_expert_parallel))
            if mesh is not None:
                model = dataclasses.replace(model, params=parallel.shard_params(model.params, mesh, model.config))
        if tokenizer is not None:  # --tokenizer: the model's own (GGUF or directory) is replaced
            model = dataclasses.replace(model, tokenizer=tokenizer)
        if args.quantization in ON_LOAD_METHODS and model.quantization is None:
            ids = calibration_ids(model.tokenizer, model.config.vocab_size)
            params = quantize_params(model.params, model.config, args.quantization, ids)
            model = dataclasses.replace(model, params=params)
        if bf16_experts:  # a LoadedModel passed in, or a float32 checkpoint holding bfloat16 values
            model = expert_bits.with_bf16_experts(model)
        # LongRoPE (Phi-3): one factor set for every request, chosen by the max_model_len served (models/longrope.py)
        model = dataclasses.replace(model, config=for_max_model_len(model.config, EngineConfig.resolve(
            args, model.config.max_position_embeddings, jax.default_backend()).max_model_len))
        self.model_dtype = model.params["embed"].dtype
        self.pipeline = self._pipeline(model, devices) if args.pipeline_parallel_size > 1 else None
        if self.pipeline is not None:  # the engine keeps the last stage's params: the sampler's
            model = dataclasses.replace(model, params=self.pipeline.sampler_params)
        self.model = model
        cfg = self.model.config
        self.tokenizer = self.model.tokenizer
        self.mm_processor = processor_for(self.model, args)  # prompts with images (jaxserve/multimodal)
        if args.chat_template and self.tokenizer is not None:
            self.tokenizer.chat_template = _read_template(args.chat_template)
        self.served_model_names = args.served_model_names or (self.model.name,)
        self.model_name = self.served_model_names[0]  # what responses and metrics report
        self.default_sampling_params = generation_defaults(args.generation_config, self.model.path,
                                                           args.override_generation_config)
        config = EngineConfig.resolve(args, cfg.max_position_embeddings, jax.default_backend())
        # (resolve_backend: the one hook tests use to run the Pallas kernels in interpret mode)
        config = dataclasses.replace(config, attention_backend=resolve_backend(args.attention_backend),
                                     kv_layout=kv_layout(cfg, config.max_model_len, args.pipeline_parallel_size,
                                                         config.batch_invariant))
        self.config = self._size_kv(config, mesh)
        self.max_model_len, self.block_size = self.config.max_model_len, self.config.block_size
        self.num_gpu_blocks, self.num_cpu_blocks = self.config.num_gpu_blocks, self.config.num_cpu_blocks
        self.scheduler = Scheduler(self.config.scheduler_config(),
                                   StructuredOutputManager(self.tokenizer, cfg.vocab_size, self.eos_token_ids))
        self.lora = (LoRAManager(cfg, args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras)
                     if args.enable_lora else None)
        lora_dtype = None if args.lora_dtype == "auto" else jnp.dtype(args.lora_dtype)
        if self.pooling_info is not None:  # a decoder embedder: the hidden rows its pooler reads
            self.pooler = pooling.Pooler.build(self.pooling_info, self.model.path, False, cfg.hidden_size)
        self.runner = ModelRunner(self.model, self.config.runner_config(), mesh, self.pipeline, self.lora, lora_dtype,
                                  pooling_rows=self.pooler.rows if self.pooler is not None else None)
        if self.runner.mm is not None:  # the encoder budget fits the processor's largest image (multimodal/)
            self.mm_processor.bind(self.runner.mm)
        self.load_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        if not args.enforce_eager:  # --enforce-eager: programs compile on first use instead
            self.runner.warmup(progress)
        self.warmup_seconds = time.perf_counter() - t1
        self._init_serving(self.config.async_scheduling, self.config.max_steps_in_flight)

    def _init_serving(self, async_scheduling: bool, max_steps_in_flight: int) -> None:
        """What every runner kind serves with, once its weights, pool and programs are ready."""
        self.compilations_at_warmup = num_compilations()
        # Everything allocated so far (weights' host copies, JAX, transformers) lives as long as
        # the engine: out of the collector's sight, a full collection no longer walks millions of
        # objects every few dozen steps (at 256 running requests it had cost ~8 ms a step).
        # (Unfrozen first: an earlier engine of this process, now garbage, is collected, not kept.)
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self._rng = np.random.default_rng(self.args.seed)
        self.outputs = OutputProcessor(self.tokenizer)
        self._pooling_requests: dict[str, tuple[list[int], float]] = {}  # id -> (prompt ids, arrival)
        self.async_scheduling, self.max_steps_in_flight = async_scheduling, max_steps_in_flight
        self._in_flight: collections.deque[tuple[SchedulerOutput, PendingStep]] = collections.deque()
        # A test hook: called at the start of every step with the ids of the requests in the engine;
        # what it raises is a failed step (engine/exceptions.py says how AsyncLLM treats each kind).
        self.fault_hook: Callable[[list[str]], None] | None = None
        self._closed = False  # from here on shutdown() has everything to release

    def _size_kv(self, config: EngineConfig, mesh: Mesh | None) -> EngineConfig:
        """`config` with its KV pools sized (worker/sizing.py's arithmetic, which `jaxserve plan` shares):
        the device blocks from the memory left after the weights and the activation peak (XLA's
        figure from a dry run on an accelerator, the shared estimate when it gives none), the host
        swap blocks from swap_space."""
        args, cfg = config.args, self.model.config
        kv_dtype = kv_pool_dtype(config.kv_cache_dtype, self.model_dtype, config.attention_backend)
        per_block = kv_bytes_per_block(cfg, config.block_size, kv_dtype, mesh, args.pipeline_parallel_size,
                                       args.tensor_parallel_size)
        if config.kv_layout is not None:  # a block of k layers (worker/kv_groups.py)
            per_block = config.kv_layout.bytes_per_block(per_block, cfg.num_layers)
        # What one device holds: its shard of each weight (tests/test_plan.py checks it against the arrays).
        tp = parallel.tensor_parallel_size(mesh) if mesh is not None else args.tensor_parallel_size
        width = jnp.dtype(self.model_dtype).itemsize
        self.weight_bytes = sizing.weight_bytes_per_device(cfg, width, tp, args.pipeline_parallel_size,
                                                           args.quantization, expert_bits.expert_width(self.model.params))
        if gguf_packed.holds_gguf(self.model.params):  # one device; the config cannot tell the file's block types
            self.weight_bytes = gguf_packed.unique_nbytes(self.model.params)
        # the LoRA slots are allocated beside the weights, before the pool (vLLM's profile run counts them)
        self.lora_bytes = _lora_bytes(args, cfg, width, tp)
        self.activation_bytes = 0
        if needs_profile(args.num_gpu_blocks_override):
            probe = config.with_blocks(config.min_blocks + 1).runner_config()
            self.activation_bytes = (self.pipeline is None and activation_bytes(self.model, probe)) or \
                sizing.activation_bytes_estimate(cfg, config.max_num_batched_tokens, args.max_num_seqs, width, tp)
        num_gpu = num_device_blocks(per_block, self.weight_bytes + self.lora_bytes, self.activation_bytes,
                                    config.min_blocks, num_gpu_blocks_override=args.num_gpu_blocks_override,
                                    gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory)
        num_cpu = int(args.swap_space * (1 << 30)) // per_block if args.preemption_mode == "swap" else 0
        return config.with_blocks(num_gpu, num_cpu)

    # ---- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release what the engine holds: unfinished requests are aborted, the KV pool, the weights it
        made (not a LoadedModel's that the caller passed in) and its compiled programs are freed.
        Idempotent; also run by `close()`, `with LLMEngine(...)` and when the engine is collected."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if getattr(self, "outputs", None) is not None and self.outputs.groups:
            self.abort_request(list(self.outputs.groups))
        self._in_flight.clear()
        owned = jax.tree.leaves(self.model.params) if self._owns_weights else []
        self.runner.shutdown()
        for x in owned:
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        self.model = dataclasses.replace(self.model, params={})

    close = shutdown

    @property
    def is_closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: JAX may already be gone
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine has been shut down; create a new one")

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
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's --max-logprobs check
            num = getattr(params, name)
            if num is not None and num > self.args.max_logprobs:
                raise ValueError(f"{name}: {num} requested, more than max_logprobs ({self.args.max_logprobs})")
        if params.use_beam_search:
            raise ValueError("use_beam_search: beam search is not supported yet; use n/best_of sampling")
        if params.best_of > self.args.max_num_seqs:
            field = "best_of" if params.best_of > params.n else "n"
            raise ValueError(f"{field}: {params.best_of} parallel samples exceed max_num_seqs "
                             f"({self.args.max_num_seqs}), so they could never run together")
        bad_bias = next((t for t in (params.logit_bias or {}) if not 0 <= t < vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias: token id {bad_bias} is out of range for a vocabulary of {vocab}")
        if any(t >= vocab for t in params.allowed_token_ids or ()):
            raise ValueError(f"allowed_token_ids: token ids must be below the vocabulary size {vocab}")
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)

    def check_lora(self, lora_request: LoRARequest | None) -> int:
        """The request's adapter id (0: none), its adapter read and checked; ValueError naming the field."""
        if lora_request is None:
            return 0
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with enable_lora=True")
        self.lora.add(lora_request)
        return lora_request.lora_int_id

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        self._check_open()
        params = params or SamplingParams()
        lora_id = self.check_lora(lora_request)
        if request_id in self.outputs.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text, token_ids = self.encode_prompt(prompt)
        token_ids, mm = self.mm_processor.apply(prompt, token_ids)  # its images' placeholders expanded
        self.validate(token_ids, params)
        eos = self.eos_token_ids
        params = dataclasses.replace(params, eos_token_ids=eos)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        child_ids = [request_id] if params.best_of == 1 else [f"{request_id}#{i}" for i in range(params.best_of)]
        self.outputs.add(request_id, text, token_ids, params, child_ids, arrival)
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        for i, child_id in enumerate(child_ids):  # (_admit: held while generation is paused)
            self._admit(Request(child_id, list(token_ids), params, arrival, eos_token_ids=eos,
                                parent_id=child_ids[0] if i else None, seed=base_seed + i, lora_int_id=lora_id,
                                mm_inputs=mm))

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput | PoolingRequestOutput]:
        outputs: list[RequestOutput | PoolingRequestOutput] = []
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            group = self.outputs.groups.get(rid)
            if group is not None:
                self.scheduler.abort_requests([s.child_id for s in group.samples])
                outputs.append(self.outputs.abort(rid))
            elif rid in self._pooling_requests:
                self.scheduler.abort_requests([rid])
                prompt, _ = self._pooling_requests.pop(rid)
                outputs.append(PoolingRequestOutput(rid, None, prompt, finished=True, aborted=True))
        return outputs

    def request_ids(self) -> list[str]:
        """Every unfinished request's id (generation and pooling alike)."""
        return list(self.outputs.groups) + list(self._pooling_requests)

    def has_unfinished_requests(self) -> bool:
        # (An async step still in flight once every request finished has nothing left to tell.)
        return bool(self.outputs.groups) or bool(self._pooling_requests) or self.scheduler.has_unfinished_requests()

    has_unfinished = has_unfinished_requests  # short alias for `while engine.has_unfinished():` loops

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: bool = True) -> "LLMEngine":
        return cls(args, progress=progress)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; with async scheduling, step N+1 is scheduled and issued before step N's
        results are read, so the device never waits for the host's update and output work.
        With P pipeline stages, up to P steps are in flight, one per stage."""
        self._check_open()
        if self.generation_blocked:  # paused or asleep (engine/sleep.py): nothing runs
            return self._blocked_step()
        if self.fault_hook is not None:
            self.fault_hook(list(self.outputs.groups))
        out = self.scheduler.schedule()
        # None when no row is constrained; a constrained request never has a step in flight here
        # (core/in_flight.py), so its matcher has seen every token before its mask is filled.
        out.token_bitmask = self.scheduler.structured.fill_bitmask(out.scheduled)
        if not self.async_scheduling:
            return self._update(out, self.runner.execute(out))
        self._in_flight.append((out, self.runner.execute_async(out)))
        # Read the oldest step back when the pipe is full, or when nothing new could be scheduled
        # (every runnable request waits on a step in flight); empty steps are read on the way.
        wait = len(self._in_flight) >= self.max_steps_in_flight or not out.scheduled
        outputs: list[RequestOutput] = []
        while self._in_flight and (wait or not self._in_flight[0][0].scheduled):
            done, pending = self._in_flight.popleft()
            outputs += self._update(done, pending.result())
            wait = wait and not done.scheduled
        return outputs

    def _update(self, out: SchedulerOutput, model_out: ModelOutput) -> list[RequestOutput | PoolingRequestOutput]:
        updates = self.scheduler.update(out, model_out)
        pooled = []
        if self._pooling_requests:
            pooled = [self._pooled(u) for u in updates if u.pooled is not None and u.request_id in self._pooling_requests]
            updates = [u for u in updates if u.pooled is None]
        self.scheduler.structured.accept_updates(updates)  # grammars advance on the accepted tokens
        outputs, stopped = self.outputs.process(out, model_out, updates)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)  # by a stop string
        return outputs + pooled if pooled else outputs

    def get_stats(self) -> EngineStats:
        compiles = num_compilations()
        stats = self.scheduler.stats()
        names = (lambda ids: tuple(self.lora.name_of(i) for i in ids)) if self.lora else (lambda ids: ())
        return EngineStats(**dataclasses.asdict(stats), num_compilations=compiles,
                           running_lora_adapters=names(stats.running_lora_ids),
                           waiting_lora_adapters=names(stats.waiting_lora_ids),
                           max_lora=self.lora.max_loras if self.lora else 0,
                           num_compilations_after_warmup=compiles - self.compilations_at_warmup,
                           num_gpu_blocks=self.num_gpu_blocks, num_cpu_blocks=self.num_cpu_blocks)

    def _pipeline(self, model: LoadedModel, devices: Sequence[jax.Device] | None) -> "parallel.pipeline.Pipeline":
        """Split the loaded params into stages on their own devices (from host copies, so the
        one-device load does not stay resident beside them)."""
        from jaxserve.parallel.pipeline import build_pipeline, host_params

        if self.args.preemption_mode == "swap":
            raise ValueError("preemption_mode: swap is not supported with pipeline_parallel_size > 1; use recompute")
        return build_pipeline(host_params(model.params), model.config, self.args.tensor_parallel_size,
                              self.args.pipeline_parallel_size, devices,
                              backend=resolve_backend(self.args.attention_backend))

    def startup_report(self) -> str:
        if self.config is None:  # an encoder: no KV pool
            return self._encoder_report()
        layout = self.config.kv_layout  # KV groups: a long request holds its sliding groups' window only
        per_req = layout.blocks_held(self.max_model_len, self.block_size) if layout else -(-self.max_model_len // self.block_size)
        kv_values = kv_values_dtype(self.config.kv_cache_dtype, self.model_dtype).name
        sharding = ("" if self.mesh is None else
                    "\n" + parallel.sharding_summary(self.mesh, self.model.config, self.model.params, self.runner.kv))
        return sharding + (f"model {self.model_name} ({self.model.config.architecture}, {self.model.config.num_layers} layers) "
                f"loaded in {self.load_seconds:.1f}s; weights: {self.weight_bytes / 2**20:.1f} MiB per device "
                f"({self.model.quantization or self.args.quantization or 'not quantized'}); KV pool: {self.num_gpu_blocks} blocks of "
                f"{self.block_size} tokens ({self.num_gpu_blocks * self.block_size} tokens, {kv_values}{layout.describe() if layout else ''}), max "
                f"concurrency at max_model_len={self.max_model_len}: {self.num_gpu_blocks / per_req:.1f}x; "
                f"swap blocks: {self.num_cpu_blocks}; "
                + ("warm-up skipped (--enforce-eager): programs compile on first use, counted by "
                   "num_compilations_after_warmup" if self.args.enforce_eager else
                   f"warm-up compiled in {self.warmup_seconds:.1f}s")
                + expert_bits.bf16_experts_note(self.model.params) + platform_defaults_note(self.config))


def platform_defaults_note(config: EngineConfig) -> str:
    """The start-up log's word on the defaults the platform picked (empty when the flags set them all)."""
    if not config.platform_defaults:
        return ""
    return (f"\nCPU defaults for flags not given: {' '.join(config.platform_defaults)} (the fastest measured on a "
            f"CPU: decode steps about 1.15x faster with 64-token blocks and 1.1-1.25x with a bfloat16 KV pool, "
            f"perplexity within 0.1% of float32; n-gram drafts verified for greedy requests, the same output, "
            f"1.2-1.8x the output tokens/s; bfloat16 dots, float32 accumulation, in steps of "
            f"{sizing.CPU_BF16_DOTS_FROM}+ tokens: about 1.3x, perplexity within 0.2% of float32; "
            f"BENCHMARKS.md). The exact float32 configuration, the one held to "
            f"transformers: --block-size {sizing.ACCELERATOR_BLOCK_SIZE} "
            f"--kv-cache-dtype {sizing.ACCELERATOR_KV_CACHE_DTYPE} --speculative-config '{{}}' --dtype float32")


def _read_template(value: str) -> str:  # a chat template given as a file's path, or as the text itself
    return Path(value).read_text() if Path(value).is_file() else value


def _lora_bytes(args: EngineArgs, cfg, width: int, tensor_parallel_size: int) -> int:
    """One device's LoRA slots (0 without --enable-lora), in --lora-dtype (auto: `width`, the model's)."""
    if not args.enable_lora:
        return 0
    lora_width = width if args.lora_dtype == "auto" else jnp.dtype(args.lora_dtype).itemsize
    return sizing.lora_slot_bytes(cfg, args.max_loras, args.max_lora_rank, lora_width, tensor_parallel_size)
