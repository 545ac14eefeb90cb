"""Pooling models in LLMEngine: the runner kind `pooling` (vLLM V1's shape: one engine core, the
kind is what the runner returns). Nothing here is a second engine; LLMEngine asks this module:

    pooling_info(args)       the runner kind, before any weight: None (generate) or the model's pooler
    pooling_args(args, info) a decoder embedder's flags for the generation runner it runs on (paged,
                             whole prompts, float KV of the model's dtype: its pool lives one step)
    refuse_flags(args, ...)  a flag that does not apply to a pooling model, named at start-up
    EncoderParts.build(...)  an encoder's (BERT family) loaded weights, scheduler and [B, S] runner
    Pooler.finish(rows)      a request's raw rows -> its embedding / logits row (host, numpy)

A decoder embedder (Qwen3-Embedding, a sentence-transformers `*Model`) runs on the generation
ModelRunner: paged attention in the kernels' memory, sliding windows, tensor / data parallel and
many hosts as for generation; each request takes its whole prompt in one step, the step hands back
the hidden rows its pooler reads, and its blocks are freed in that step's update.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve import parallel
from jaxserve.core.prefill_only import PaddedBatching, length_buckets, power_buckets
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.scheduler_output import RequestUpdate
from jaxserve.engine.args import EngineArgs
from jaxserve.models.bert import ENCODER_ARCHITECTURES, EncoderConfig
from jaxserve.multimodal.options import MM_FLAG_DEFAULTS
from jaxserve.pooling import pooler as pooler_lib
from jaxserve.pooling.config import PoolingModelInfo, read_pooling_info
from jaxserve.pooling.outputs import PoolingOutput, PoolingRequestOutput
from jaxserve.weights.encoder import LoadedEncoder, load_encoder
from jaxserve.weights.loader import load_tokenizer, resolve_dtype
from jaxserve.weights.source import resolve_model_path
from jaxserve.worker import sizing
from jaxserve.worker.encoder_runner import EncoderRunner, check_tensor_parallel, place_on

DEFAULT_ENCODER_BATCHED_TOKENS = 8192  # an encoder step's [B, S] budget when the flag is not given
SMALLEST_SEQ_BUCKET = 16
_NO_SAMPLING = SamplingParams(max_tokens=1)  # a pooling request samples nothing; its Request wants params


def pooling_info(args: EngineArgs, path: Path | None = None) -> PoolingModelInfo | None:
    """The model's pooler when it runs as a pooling model (runner pooling, or auto on an embedding or
    reranking checkpoint), else None; ValueError naming the flag when runner and model disagree.
    `path`: the model's directory when a LoadedModel was passed in (else --model's)."""
    path = path if path is not None else resolve_model_path(args.model)
    info = read_pooling_info(path, args.runner, args.convert, args.override_pooler_config)
    return info if info.runner == "pooling" else None


def is_encoder(info: PoolingModelInfo) -> bool:
    return info.architecture in ENCODER_ARCHITECTURES


def refuse_flags(args: EngineArgs, encoder: bool) -> None:
    """A flag given that does nothing for this pooling model is refused at start-up, by name."""
    refused = {
        "enable_lora": args.enable_lora,  # the pooling routes take no adapter
        "speculative_config": bool(args.speculative_config),  # nothing is sampled
        "pipeline_parallel_size": args.pipeline_parallel_size > 1,
        "enable_prefix_caching": args.enable_prefix_caching,  # a prompt's blocks live one step
        "preemption_mode": args.preemption_mode == "swap",
        "generation_config": args.generation_config != "auto",  # nothing is sampled
        "override_generation_config": bool(args.override_generation_config),
        **{name: getattr(args, name) != default for name, default in MM_FLAG_DEFAULTS.items()},  # no images
    }
    if encoder:  # no KV pool, no paged runner
        refused.update({
            "quantization": args.quantization is not None,
            "kv_cache_dtype": args.kv_cache_dtype not in (None, "auto"),
            "block_size": args.block_size is not None,
            "num_gpu_blocks_override": args.num_gpu_blocks_override is not None,
            "kv_cache_memory": args.kv_cache_memory is not None,
            "enable_expert_parallel": args.enable_expert_parallel,
            "attention_backend": args.attention_backend not in ("auto", "xla"),
            "num_hosts": args.num_hosts > 1,
            "async_scheduling": args.async_scheduling is False,
            "enable_sleep_mode": args.enable_sleep_mode,  # sleep frees a paged runner's pool and weights
        })
    given = [name for name, bad in refused.items() if bad]
    if given:
        kind = "an encoder" if encoder else "a pooling model"
        raise ValueError(f"{given[0]}: does not apply to {kind} (embeddings, scores): "
                         f"remove --{given[0].replace('_', '-')}")


def max_model_len(info: PoolingModelInfo, model_len: int, args: EngineArgs) -> int:
    """The context: the smallest of the position table, sentence-transformers' max_seq_length and the flag."""
    return min(n for n in (model_len, info.max_seq_length, args.max_model_len) if n)


def pooling_args(args: EngineArgs, info: PoolingModelInfo, model_len: int) -> EngineArgs:
    """A decoder embedder's flags on the generation runner: whole prompts (never chunked), a float KV
    pool of the model's dtype unless the flag says otherwise (the pool holds a prompt for one step:
    rounding it buys no capacity worth its error), no drafts (nothing is sampled)."""
    return dataclasses.replace(
        args, max_model_len=max(2, max_model_len(info, model_len, args)), enable_chunked_prefill=False,
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        speculative_config=args.speculative_config if args.speculative_config is not None else {})


@dataclass
class EncoderParts:
    """What an encoder engine runs with, in place of the generation model, pool and runner."""
    model: LoadedEncoder
    tokenizer: object
    scheduler: Scheduler
    runner: EncoderRunner
    max_model_len: int
    load_seconds: float

    @classmethod
    def build(cls, args: EngineArgs, info: PoolingModelInfo, mesh: Mesh | None) -> "EncoderParts":
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        path = resolve_model_path(args.model)
        if mesh is not None:
            hf = json.loads((path / "config.json").read_text())  # before any weight is read
            check_tensor_parallel(EncoderConfig.from_hf(hf), parallel.tensor_parallel_size(mesh))
        model = load_encoder(path, args.model or str(path), resolve_dtype(args.dtype),
                             place_on(mesh) if mesh is not None else None)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else AutoTokenizer.from_pretrained(str(path))
        limit = max_model_len(info, model.config.max_model_len, args)
        budget = max(args.max_num_batched_tokens or DEFAULT_ENCODER_BATCHED_TOKENS, limit)
        padded = PaddedBatching(
            seq_buckets=length_buckets(min(SMALLEST_SEQ_BUCKET, limit), limit),
            # Rows in powers of 4: a busy server fills its rows anyway, and each length bucket then
            # costs 3-4 programs, not 6-7 (compile time is a user's cost).
            batch_buckets=power_buckets(args.max_num_seqs, 4))
        # num_blocks is unused: the [B, S] program runs attention inside the step, no KV pool.
        scheduler = Scheduler(SchedulerConfig(num_blocks=1, max_num_seqs=args.max_num_seqs,
                                              max_num_batched_tokens=budget, max_model_len=max(limit, 2),
                                              padded_batching=padded))
        # --dtype auto on one CPU device with bfloat16 dot instructions: bfloat16 dots, as the
        # generation runner's (the steps an encoder runs are all past its 64-token threshold)
        bf16 = (args.dtype == "auto" and mesh is None
                and sizing.default_bf16_dots_from(jax.default_backend() == "cpu") > 0)
        runner = EncoderRunner(model.params, model.config, padded.grid(args.max_num_seqs, budget),
                               task=info.task or "embed", pooling_type=info.pooler.pooling_type,
                               bf16_dots=bf16, mesh=mesh)
        return cls(model, tokenizer, scheduler, runner, limit, time.perf_counter() - t0)


@dataclass(frozen=True)
class Pooler:
    """A request's raw rows (the runner's) -> its result row: pooled (a decoder's rows, on the host),
    then the model's post-processing (sentence-transformers' Dense / Normalize) for an embedding."""
    info: PoolingModelInfo
    post: pooler_lib.Pooler  # Dense / Normalize of the model directory's pipeline (pooling/pooler.py)
    pooled_on_device: bool  # an encoder's runner pools in its program; a decoder's hands back rows

    @classmethod
    def build(cls, info: PoolingModelInfo, model_dir, encoder: bool, hidden_size: int) -> "Pooler":
        return cls(info, pooler_lib.Pooler.from_model_dir(model_dir, info, hidden_size), encoder)

    def dimension(self, hidden_size: int) -> int:
        """An embedding's width: the model's hidden size, or the last Dense module's output."""
        return self.post.dimension(hidden_size)

    @property
    def rows(self) -> str:
        """Which hidden rows of a prompt the generation runner hands back for this pooler."""
        return pooler_lib.rows_needed(self.info.pooler.pooling_type)

    def finish(self, raw: np.ndarray) -> np.ndarray:
        """[D] f32: the embedding (post-processed) or the classifier's logits (as they are)."""
        row = np.asarray(raw, np.float32)
        if not self.pooled_on_device:
            row = pooler_lib.pool_rows(row, self.info.pooler.pooling_type)
        return row if self.info.task == "classify" else self.post.postprocess(row)


def model_dtype_of(params: dict) -> jnp.dtype:
    leaf = params.get("embed", params.get("word_embed"))
    return leaf.dtype


class PoolingRequests:
    """LLMEngine's pooling side (a mixin of the one engine, not a second one): an encoder's start-up,
    prefill-only requests in, PoolingRequestOutputs out. The attributes are LLMEngine's."""

    pooler: Pooler | None
    pooling_info: PoolingModelInfo | None

    def _init_encoder(self, parts: "EncoderParts", progress: bool) -> None:
        """An encoder (BERT family): its padded [B, S] runner instead of the model, pool and paged runner;
        the rest of the engine (requests, steps in flight, stats, shutdown) is the same."""
        self._owns_weights, self.pipeline, self.config, self.lora = True, None, None, None
        self.model, self.tokenizer, self.scheduler, self.runner = parts.model, parts.tokenizer, parts.scheduler, parts.runner
        self.pooler = Pooler.build(self.pooling_info, self.model.path, True, self.model.config.hidden_size)
        self.model_dtype = model_dtype_of(self.model.params)
        self.served_model_names = self.args.served_model_names or (self.model.name,)
        self.model_name = self.served_model_names[0]
        self.default_sampling_params = {}  # nothing is sampled
        self.max_model_len, self.block_size, self.num_gpu_blocks, self.num_cpu_blocks = parts.max_model_len, 1, 0, 0
        self.weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.model.params)) // (
            parallel.tensor_parallel_size(self.mesh) if self.mesh is not None else 1)
        self.load_seconds = parts.load_seconds
        t1 = time.perf_counter()
        self.num_warmup_compilations = 0 if self.args.enforce_eager else self.runner.warmup(progress)
        self.warmup_seconds = time.perf_counter() - t1
        self._init_serving(async_scheduling=True, max_steps_in_flight=2)  # the host packs while the device runs

    @property
    def runner_kind(self) -> str:
        """vLLM's --runner as resolved: "pooling" (embeddings, scores) or "generate"."""
        return "pooling" if self.pooler is not None else "generate"

    def check_pooling_input(self, token_ids: list[int], field: str = "input") -> None:
        """ValueError naming `field` for an input this pooling model cannot take; safe from any thread."""
        if self.pooler is None:
            raise ValueError("runner: this model generates text (runner generate); embeddings and scores need "
                             "a pooling model (runner pooling)")
        if not token_ids:
            raise ValueError(f"{field}: an input has no tokens (an empty text without special tokens)")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{field}: this model's maximum context length is {self.max_model_len} tokens, "
                             f"but the input has {len(token_ids)} tokens; shorten it or set truncate_prompt_tokens")
        vocab = self.model.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab})")

    def add_pooling_request(self, request_id: str, token_ids: list[int], token_type_ids: list[int] | None = None,
                            arrival_time: float | None = None) -> None:
        """A prefill-only request: one step computes its whole prompt; its output is a PoolingRequestOutput
        (the embedding, or the classifier's logits)."""
        self._check_open()
        self.check_pooling_input(token_ids)
        if request_id in self.outputs.groups or request_id in self._pooling_requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._pooling_requests[request_id] = (list(token_ids), arrival)
        self.scheduler.add_request(Request(request_id, list(token_ids), _NO_SAMPLING, arrival, pooling=True,
                                           token_type_ids=None if token_type_ids is None else list(token_type_ids)))

    def _pooled(self, update: RequestUpdate) -> PoolingRequestOutput:
        """A pooling request's output from its step's raw rows (the pooler finishes them on the host)."""
        prompt, _ = self._pooling_requests.pop(update.request_id)
        return PoolingRequestOutput(update.request_id, PoolingOutput(self.pooler.finish(update.pooled)), prompt)

    def _encoder_report(self) -> str:
        info = self.pooling_info
        return (f"pooling model {self.model_name} ({self.model.config.architecture}, {info.task}, "
                f"{info.pooler.pooling_type} pooling{', bfloat16 dots' if self.runner.bf16_dots else ''}) loaded in "
                f"{self.load_seconds:.1f}s; weights: {self.weight_bytes / 2**20:.1f} MiB per device; "
                f"max_model_len {self.max_model_len}; {self.num_warmup_compilations} [B, S] programs compiled "
                f"in {self.warmup_seconds:.1f}s")
