"""The device side of a step: block copies/swaps, the jitted model step, the jitted sampler.

Two programs run per step, both compiled during warm-up:
    model_step[T, decode_only]  (params, kv, batch) -> kv (donated, in place), hidden [P, hidden] at the
                         sampling tokens' last positions, P = max seq bucket; decode_only: Pallas only
    sample_step[S, var]  (params, hidden, sampling metadata) -> tokens, logprobs  (LM head on S rows)
Splitting them keeps the compile grid small: the model compiles once per token bucket T (and
decode-only bucket), the LM head plus sampler once per (seq bucket S, sampler variant), not the product.

A step is `execute = run(prepare(...))`:
    prepare(sched_out) -> PreparedStep      host only: numpy batch, block ops, sampler inputs
    run(prepared) -> ModelOutput            device only: the same programs in the same order
so a multi-host run (engine/multihost.py) builds the PreparedStep on rank 0, sends it to
every other rank, and all ranks call `run` on it (JAX's multi-controller model). The
scheduler's output is all `prepare` reads: it never sees a live Request. The jitted
programs themselves are in worker/programs.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxserve import parallel
from jaxserve.worker import batch_invariant
from jaxserve.worker.kv_groups import KVLayout
from jaxserve.worker.programs import (_copy_blocks, _fetch, _gather_blocks, _gather_rows, _model_step,  # noqa: F401
                                      _model_step_fn, _prompt_logprobs_step, _rows_like, _sample_step,
                                      _scatter_blocks, StepPrograms, num_compilations)
from jaxserve.parallel.jit import fresh_jit
from jaxserve.worker.step_rows import (PROMPT_LOGPROB_ROWS, PromptLogprobChunk, in_chunks,  # noqa: F401
                                       pooling_chunks, prompt_logprob_chunks)
from jaxserve.worker.input_batch import (StepInput, bucket_for, is_decode_only, one_row_buckets, pack, step_grids,
                                         step_seq_buckets, step_token_buckets)
from jaxserve.sample.sampler import SamplerOutput, vocab_slices
from jaxserve.sample.sampling_metadata import RowInfo, SamplingMetadata, min_tokens_suppress_ids
from jaxserve.core.scheduler_output import ModelOutput, SampledToken, SchedulerOutput
from jaxserve.models.attention import PALLAS_BACKENDS, kv_pool_dtype
from jaxserve.models.kv_layout import pool_shapes
from jaxserve.models.expert_weights import with_layer_views
from jaxserve.quantization.matmul import has_columns
from jaxserve.weights.loader import LoadedModel
from jaxserve.lora import layers as lora_layers
from jaxserve.lora.manager import LoRAManager, SlotTable


@dataclass(frozen=True)
class RunnerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    backend: str = "xla"
    num_cpu_blocks: int = 0
    kv_cache_dtype: str = "auto"  # EngineArgs.kv_cache_dtype
    bf16_dots_from: int = 0  # steps of this many tokens or more take bfloat16 dots (llama.run_layers); 0: none
    logprobs_mode: str = "raw_logprobs"  # EngineArgs.logprobs_mode (sample/sampler.py)
    head_float32: bool = False  # EngineArgs.head_dtype == "float32" (worker/lm_head.py)
    batch_invariant: bool = False  # EngineArgs.batch_invariant (worker/batch_invariant.py)
    kv_layout: KVLayout | None = None  # sliding-window KV groups (worker/kv_groups.py); None: one table

    @property
    def num_kv_groups(self) -> int:
        return self.kv_layout.num_groups if self.kv_layout is not None else 1

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def kv_dtype(self, model_dtype) -> jnp.dtype:
        """The KV pool's array dtype for a model of `model_dtype` (see attention.kv_pool_dtype)."""
        return kv_pool_dtype(self.kv_cache_dtype, model_dtype, self.backend)


@dataclass(frozen=True)
class PreparedStep:
    """One step's device work as plain host data (numpy, ints, strings): picklable, so rank 0 of a
    multi-host run can send it to the other ranks, which replay it with `ModelRunner.run`."""
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    # (slot, lora id) adapters written into LoRA slots before the step (host arrays from the LoRAManager)
    lora_writes: list[tuple[int, int]] = field(default_factory=list)
    batch: StepInput | None = None  # numpy leaves, padded to a token bucket; None: no model step
    rows: np.ndarray | None = None  # [P] i32, each sampling request's last flat row, 0 padded
    prompt_logprobs: list[PromptLogprobChunk] = field(default_factory=list)
    sampling: SamplingMetadata | None = None  # numpy leaves, padded to a seq bucket; None: nobody samples
    # (request id, top-N logprobs, draft index) per row; draft index 0: the row of the last real
    # token, j > 0: the row after the request's j-th speculative draft
    sample_ids: list[tuple[str, int, int]] = field(default_factory=list)
    # prefill-only (pooling) requests: the flat rows of their hidden states the host pools, in
    # chunks of PROMPT_LOGPROB_ROWS (0 padded), and (request id, number of rows) in their order
    pooling_rows: list[np.ndarray] = field(default_factory=list)
    pooling_ids: list[tuple[str, int]] = field(default_factory=list)
    mm: object | None = None  # a vision-language step's image rows (multimodal/runner.MultiModalStep); None: none

    @property
    def has_device_work(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy_blocks or self.lora_writes) or self.batch is not None


@dataclass
class PendingStep:
    """A dispatched step: `result()` waits for its sampled tokens and reads them to the host."""
    prepared: PreparedStep
    prompt_logprobs: dict[str, dict[int, SampledToken]] = field(default_factory=dict)
    sampled: SamplerOutput | None = None  # device arrays until result()
    pooled: list[jax.Array] = field(default_factory=list)  # [PROMPT_LOGPROB_ROWS, hidden] per pooling chunk

    def result(self) -> ModelOutput:
        out = ModelOutput(prompt_logprobs=self.prompt_logprobs)
        if self.pooled:  # each pooling request's hidden rows [n, hidden] f32; the engine pools them
            rows = np.concatenate([np.asarray(r, np.float32) for r in _fetch(self.pooled)])
            start = 0
            for rid, n in self.prepared.pooling_ids:
                out.pooled[rid] = rows[start:start + n]
                start += n
        if self.sampled is None:
            return out
        so = _fetch(self.sampled)
        for i, (rid, n, j) in enumerate(self.prepared.sample_ids):
            token = _sampled(so, i, int(so.token_ids[i]), n)
            if j == 0:
                out.sampled[rid] = token
            else:
                out.draft_sampled.setdefault(rid, []).append(token)
        return out


class ModelRunner:
    def __init__(self, model: LoadedModel, rc: RunnerConfig, mesh: Mesh | None = None, pipeline=None,
                 lora: LoRAManager | None = None, lora_dtype=None, pooling_rows: str | None = None) -> None:
        """`pooling_rows` (a pooling model's runner; None: a generation model's): which hidden rows of a
        prefill-only request the step hands back, "first", "last" or "all" of its prompt (what its
        pooler reads; jaxserve/pooling/pooler.py). Such a runner samples nothing, so its warm-up
        compiles one sampler program (the one that places the model step's inputs), not every variant."""
        self.model, self.rc, self.cfg = model, rc, model.config
        self.pooling_rows = pooling_rows
        # sharded over `mesh` when there is one; with a `pipeline` (parallel/pipeline.py) its stages
        # hold the layers and the pool, and these are the last stage's params (the sampler's)
        self.params, self.pipeline = model.params, pipeline
        if mesh is None and pipeline is None:  # committed to their device (no copy), as an update's new arrays
            self.params = jax.device_put(self.params, _device_of(self.params))  # are: else each recompiles
        self.programs = StepPrograms()  # this runner's own executables, freed by shutdown()
        programs = self.programs
        self.lora, self.lora_slots = lora, SlotTable(lora.max_loras) if lora is not None else None
        if lora is not None:  # the adapters' stacked slots ride in the params (jaxserve/lora/layers.py)
            self.params = _with_lora_slots(self.params, self.cfg, lora, lora_dtype or self.params["embed"].dtype, mesh)
            self._write_lora(1, None)  # the slots as the write program leaves them, so every program
            # compiles for that placement and a later write changes nothing the programs are keyed on
        if pipeline is None and mesh is None and rc.backend not in PALLAS_BACKENDS:
            # a MoE model's expert stacks, each layer also as an array of its own sharing their memory
            # (one CPU device): the batched expert dots read them in place (models/expert_weights.py)
            self.params = {**self.params, "layers": with_layer_views(self.params["layers"])}
        dtype = rc.kv_dtype((pipeline.params[0] if pipeline else self.params)["embed"].dtype)
        # KV groups: a block holds k layers of whichever group owns it (worker/kv_groups.py)
        pool_layers = rc.kv_layout.size if rc.kv_layout is not None else self.cfg.num_layers
        if pipeline is not None:
            self.kv = pipeline.make_kv_cache(rc.num_blocks, rc.block_size, dtype)
        elif mesh is None:
            # committed to the params' device, as the step's outputs are: else an eager engine's first
            # step compiles the model program for an uncommitted pool, and the next one again
            self.kv = jax.device_put(tuple(jnp.zeros(shape, dtype) for shape in
                                           pool_shapes(self.cfg, rc.num_blocks, rc.block_size, pool_layers)),
                                     _device_of(self.params))
        else:  # the pool split on its kv-head axis; the jitted programs follow the inputs' shardings
            self.kv = parallel.make_sharded_kv_cache(mesh, self.cfg, rc.num_blocks, rc.block_size, dtype,
                                                     num_layers=pool_layers)
        self.token_buckets, self.decode_buckets, self.seq_buckets = step_grids(
            rc.backend in PALLAS_BACKENDS, rc.max_num_seqs, rc.max_num_batched_tokens,
            one_row=pipeline is None and not rc.batch_invariant and one_row_buckets(self.params))
        if rc.batch_invariant:  # every dot at M >= 64 (worker/batch_invariant.py)
            if self.cfg.moe is not None:
                raise ValueError("batch_invariant: mixture-of-experts models group tokens by expert across the batch")
            self.token_buckets, self.seq_buckets = map(batch_invariant.grid, (self.token_buckets, self.seq_buckets))
        self.num_mask_words = (self.cfg.vocab_size + 31) // 32  # the sampler's token bitmask width
        self.num_rows = self.seq_buckets[-1]  # P: hidden rows handed from the model step to the sampler
        self.copy_width = self.num_rows  # block pairs per copy/swap program call
        host_shapes = pool_shapes(self.cfg, rc.num_cpu_blocks, rc.block_size, pool_layers)
        self.host_kv = tuple(np.zeros(s, dtype) for s in host_shapes) if rc.num_cpu_blocks else None
        self._copy_blocks = (pipeline.per_stage(programs.copy_blocks) if pipeline is not None
                             else programs.copy_blocks)
        self._model_step = (pipeline.step if pipeline is not None else
                            functools.partial(programs.model_step, cfg=self.cfg, backend=rc.backend,
                                              bf16_dots_from=rc.bf16_dots_from))
        self._sample_step = functools.partial(programs.sample_step, num_rows=self.num_rows,
                                              vocab_slices=0 if rc.batch_invariant else _head_slices(
                                                  self.params, mesh, pipeline),
                                              head_dots=rc.bf16_dots_from > 0 and not rc.head_float32,
                                              logprobs_mode=rc.logprobs_mode, head_float32=rc.head_float32,
                                              logit_softcap=self.cfg.final_logit_softcap)
        # Async scheduling: the last sampled ids stay on the device ([P] i32) and feed the next
        # step's PLACEHOLDER inputs; prepare() maps request ids to their rows in them.
        # A mesh (or pipeline stages) over several processes: host inputs go to the programs as
        # numpy (each process holds the same values), not device_put onto this process's default device.
        self.multi_process = ((mesh is not None and not all(d.process_index == jax.process_index()
                                                             for d in mesh.devices.flat))
                              or (pipeline is not None and pipeline.multi_process))
        # What the host reads of the sampler's outputs: on stages over several processes, brought
        # from the last stage to every stage first (rank 0 schedules, on stage 0).
        self._publish = pipeline.publish if pipeline is not None else (lambda tree: tree)
        zeros = np.zeros(self.num_rows, np.int32)
        self._prev_tokens = zeros if pipeline is not None and pipeline.multi_process else jax.device_put(
            zeros, _device_of(self.params) if mesh is None and pipeline is None else None)  # committed: as above
        self._prev_sample_rows: dict[str, int] = {}
        self.mm = None  # a vision-language model's M-RoPE positions and image rows (jaxserve/multimodal/runner.py)
        if self.cfg.vision is not None:
            from jaxserve.multimodal.runner import MultiModalRunner

            self.mm = MultiModalRunner(self.cfg.vision, self.params["embed"].dtype, rc.max_num_batched_tokens)

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> int:
        """Compile every program serving can run; returns how many compilations that took."""
        before = num_compilations()
        jp = self.programs
        variants = [(s, md) for s in self.seq_buckets
                    for md in SamplingMetadata.warmup_variants(s, self.rc.max_model_len, self.num_mask_words)]
        variants = variants[:1] if self.pooling_rows is not None else variants
        programs = [(t, False) for t in self.token_buckets[1:]] + [(t, True) for t in self.decode_buckets]
        total = 1 + len(programs) + len(variants) + (3 if self.host_kv is not None else 1)
        with tqdm(total=total, desc="Warm-up (compiling buckets)", unit="program", disable=not progress) as bar:
            q_rows = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
            rows = np.zeros(self.num_rows, np.int32)
            # The smallest bucket runs (its outputs are the later programs' example inputs); the
            # others are compiled ahead of time, not run: jit's own cache then holds them, and
            # a restart loading them from the persistent cache skips about 4 s of empty steps.
            smallest = self._empty_batch(self.token_buckets[0])
            self.kv, hidden, full = self._model_step(self.params, self.kv, smallest, rows, self._prev_tokens)
            # Serving feeds the model step the sampler's ids, placed as the sampler leaves them (on a
            # replica's mesh, not the default device): compile every model program for that input.
            _, self._prev_tokens = self._sample_step(self.params, hidden, self._input(variants[0][1]))
            self.kv, hidden, full = self._model_step(self.params, self.kv, smallest, rows, self._prev_tokens)
            jp.gather_rows(full, q_rows)
            bar.update(1)
            for t, decode in programs:  # decode: a decode-only step's program (Pallas: the decode kernel)
                if self.pipeline is not None:  # its stage programs compile by running the bucket
                    self.kv, _, _ = self._model_step(self.params, self.kv, self._empty_batch(t, decode), rows,
                                                     self._prev_tokens)
                else:
                    jp.model_step.lower(self.params, self.kv, self._empty_batch(t, decode), rows, self._prev_tokens,
                                      cfg=self.cfg, backend=self.rc.backend,
                                      bf16_dots_from=self.rc.bf16_dots_from).compile()
                # Run on a program's output, as serving calls it: neither `.lower(ShapeDtypeStruct)
                # .compile()` nor a device_put array was the entry a prompt-logprobs step looks up.
                jp.gather_rows(jp.rows_like(full, t), q_rows)
                bar.update(1)
            _fetch(self._publish(jp.prompt_logprobs_step(self.params, jp.gather_rows(full, q_rows), q_rows,
                                                         logit_softcap=self.cfg.final_logit_softcap)))
            for _, md in variants:
                _fetch(self._publish(self._sample_step(self.params, hidden, self._input(md))[0]))
                bar.update(1)
            pad = np.full(self.copy_width, self.rc.num_blocks, np.int32)
            self.kv = self._copy_blocks(self.kv, np.zeros_like(pad), pad)
            bar.update(1)
            if self.host_kv is not None:
                k, v = _fetch(jp.gather_blocks(self.kv, np.zeros_like(pad)))
                self.kv = jp.scatter_blocks(self.kv, pad, k, v)
                bar.update(2)
        jax.block_until_ready(self.kv)
        if self.mm is not None:  # the vision tower's patch buckets, up to the encoder budget
            self.mm.warmup(self.params["vision"])
        return num_compilations() - before

    def shutdown(self, owns_params: bool = False) -> None:
        """Free the KV pool (and the params when `owns_params`: weights the caller passed in may be
        another engine's too) and this runner's compiled programs; the runner is unusable after."""
        if self.programs is None:
            return
        owned = [self.kv, self._prev_tokens] + ([self.params] if owns_params else [])
        for x in jax.tree.leaves(owned):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        if self.pipeline is not None:
            self.pipeline.release()
        self.programs.release()
        self.programs = self.kv = self.params = self.host_kv = self._prev_tokens = None
        self._model_step = self._sample_step = self._copy_blocks = self._publish = None

    def _empty_batch(self, num_tokens: int, decode_only: bool = False) -> StepInput:
        batch, _ = pack(SchedulerOutput(), num_tokens, self.rc.max_num_seqs, self.rc.max_blocks_per_seq,
                        self.rc.block_size, decode_only=decode_only, num_groups=self.rc.num_kv_groups)
        batch = self._per_token(batch)
        return batch if self.mm is None else self.mm.text_batch(batch)

    def _per_token(self, batch: StepInput) -> StepInput:
        """--batch-invariant: each token its own sequence for the attention (worker/batch_invariant.py)."""
        return batch_invariant.per_token_attention(batch, self.token_buckets[-1]) if self.rc.batch_invariant else batch

    def _input(self, tree):
        """Host inputs for a program: one device_put of the whole tree, or numpy across processes."""
        return jax.device_get(tree) if self.multi_process else jax.device_put(tree)

    # ---- one step --------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        return self.execute_async(out).result()

    def execute_async(self, out: SchedulerOutput) -> PendingStep:
        """Issue the step's device work and return without waiting for it."""
        return self.dispatch(self.prepare(out))

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """Everything host-side: pack the batch, pick the sampling rows, build the sampler inputs."""
        ops = dict(swap_out=list(out.swap_out), swap_in=list(out.swap_in), copy_blocks=list(out.copy_blocks))
        lora_slots = None
        if self.lora_slots is not None and out.scheduled:
            lora_slots, ops["lora_writes"] = self.lora_slots.assign({sr.lora_int_id for sr in out.scheduled})
        prepared = self._prepare(out, ops, lora_slots)
        self._prev_sample_rows = {rid: i for i, (rid, _, j) in enumerate(prepared.sample_ids) if j == 0}
        return prepared

    def _prepare(self, out: SchedulerOutput, ops: dict, lora_slots: dict[int, int] | None = None) -> PreparedStep:
        if not out.scheduled:
            return PreparedStep(**ops)
        decode_only = bool(self.decode_buckets) and is_decode_only(out)  # Pallas: the decode kernel's programs
        t = bucket_for(out.num_batched_tokens, self.decode_buckets if decode_only else self.token_buckets)
        batch, sample_rows = pack(out, t, self.rc.max_num_seqs, self.rc.max_blocks_per_seq, self.rc.block_size,
                                  self._prev_sample_rows, decode_only=decode_only, lora_slots=lora_slots,
                                  num_groups=self.rc.num_kv_groups)
        batch = self._per_token(batch)
        if self.mm is not None:
            batch, ops["mm"] = self.mm.prepare(out, batch)
        rows = np.zeros(self.num_rows, np.int32)
        rows[: len(sample_rows)] = sample_rows
        prompt_lps = prompt_logprob_chunks(out)
        infos, sample_ids = [], []
        for sr in out.scheduled:
            if not sr.sample:
                continue
            params, outputs = sr.sampling_params, sr.output_token_ids
            drafts = sr.token_ids[len(sr.token_ids) - sr.num_drafts:]
            for j in range(sr.num_drafts + 1):  # row j: as if drafts[:j] were already accepted
                infos.append(RowInfo(params, sr.seed, sr.num_output_tokens + j, sr.prompt_token_ids,
                                     outputs + drafts[:j] if j else outputs,
                                     min_tokens_suppress_ids(params, sr.num_output_tokens + j)))
                sample_ids.append((sr.request_id, params.logprobs or 0, j))
        if self.pooling_rows is not None:
            ops["pooling_rows"], ops["pooling_ids"] = pooling_chunks(out, self.pooling_rows)
        if not infos:
            return PreparedStep(**ops, batch=batch, rows=rows, prompt_logprobs=prompt_lps)
        md = SamplingMetadata.build_host(infos, bucket_for(len(infos), self.seq_buckets), self.rc.max_model_len,
                                         out.token_bitmask, self.num_mask_words)
        return PreparedStep(**ops, batch=batch, rows=rows, prompt_logprobs=prompt_lps, sampling=md,
                            sample_ids=sample_ids)

    def run(self, p: PreparedStep) -> ModelOutput:
        """Everything on the device, from host data only: every rank of a multi-host run calls this
        with the same PreparedStep and so issues the same programs in the same order."""
        return self.dispatch(p).result()

    def dispatch(self, p: PreparedStep) -> PendingStep:
        """Issue the step's programs; only the prompt logprobs (rare) are waited for here."""
        self._apply_block_ops(p)
        for slot, lora_id in p.lora_writes:
            self._write_lora(slot, lora_id)
        if p.batch is None:
            return PendingStep(p)
        batch = p.batch if self.mm is None else self.mm.attach(p.batch, p.mm, self.params)  # the image rows
        self.kv, hidden, full = self._model_step(self.params, self.kv, batch, p.rows, self._prev_tokens)
        prompt_lps = self._prompt_logprobs(p.prompt_logprobs, full)
        # (the gather program is the prompt logprobs' one: compiled per token bucket at warm-up)
        pooled = [self._publish(self.programs.gather_rows(full, rows)) for rows in p.pooling_rows]
        if p.sampling is None:
            return PendingStep(p, prompt_lps, pooled=pooled)
        so, self._prev_tokens = self._sample_step(self.params, hidden, self._input(p.sampling))
        return PendingStep(p, prompt_lps, self._publish(so), pooled)

    def _write_lora(self, slot: int, lora_id: int | None) -> None:
        """Adapter `lora_id`'s host copy (None: zeros) into device slot `slot`: a device update, no compile."""
        weights = self.lora.weights(lora_id) if lora_id else None
        new = lora_layers.padded(weights, self.cfg, self.lora.max_lora_rank)
        layers = self.params["layers"]
        start = np.int32((slot - 1) * self.lora.max_lora_rank)
        written = lora_layers.write_slot(layers["lora"], new, start)
        self.params = {**self.params, "layers": {**layers, "lora": written}}

    def _prompt_logprobs(self, chunks: list[PromptLogprobChunk],
                         hidden: jax.Array) -> dict[str, dict[int, SampledToken]]:
        """Logprobs of the chunks' prompt tokens, from this step's hidden states."""
        result: dict[str, dict[int, SampledToken]] = {}
        for c in chunks:
            p = self.programs
            so = _fetch(self._publish(p.prompt_logprobs_step(self.params, p.gather_rows(hidden, c.rows), c.targets,
                                                             logit_softcap=self.cfg.final_logit_softcap)))
            for i, (rid, pos, tok, n) in enumerate(c.entries):
                result.setdefault(rid, {})[pos] = _sampled(so, i, tok, n)
        return result

    def _apply_block_ops(self, p: PreparedStep) -> None:
        # The scheduler's order: a block freed by a swap-out may be this step's swap-in or copy target.
        if p.swap_out:
            self._swap_out(p.swap_out)
        if p.swap_in:
            self._swap_in(p.swap_in)
        for chunk in in_chunks(p.copy_blocks, self.copy_width):
            src, dst = self._pad_pairs(chunk)
            self.kv = self._copy_blocks(self.kv, src, dst)

    def _pad_pairs(self, pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        src = np.zeros(self.copy_width, np.int32)
        dst = np.full(self.copy_width, self.rc.num_blocks, np.int32)
        src[: len(pairs)], dst[: len(pairs)] = zip(*pairs)
        return src, dst

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        assert self.host_kv is not None, "swap_out without a host pool"
        for chunk in in_chunks(pairs, self.copy_width):
            dev, _ = self._pad_pairs(chunk)
            k, v = _fetch(self.programs.gather_blocks(self.kv, dev))
            host_ids = [c for _, c in chunk]
            self.host_kv[0][:, :, host_ids] = k[:, :, : len(chunk)]
            self.host_kv[1][:, :, host_ids] = v[:, :, : len(chunk)]

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        assert self.host_kv is not None, "swap_in without a host pool"
        for chunk in in_chunks(pairs, self.copy_width):
            host_ids = [c for c, _ in chunk]
            dev = np.full(self.copy_width, self.rc.num_blocks, np.int32)
            dev[: len(chunk)] = [d for _, d in chunk]
            shape = list(self.host_kv[0].shape)
            shape[2] = self.copy_width
            k, v = np.zeros(shape, self.host_kv[0].dtype), np.zeros(shape, self.host_kv[1].dtype)
            k[:, :, : len(chunk)] = self.host_kv[0][:, :, host_ids]
            v[:, :, : len(chunk)] = self.host_kv[1][:, :, host_ids]
            self.kv = self.programs.scatter_blocks(self.kv, dev, k, v)


def _with_lora_slots(params: dict, cfg, lora: LoRAManager, dtype, mesh: Mesh | None) -> dict:
    """`params` plus empty LoRA slots: layers["lora"] and the columns' owners (jaxserve/lora/layers.py),
    split with their projections over `mesh`."""
    slots, owner = lora_layers.init_slots(cfg, lora.max_loras, lora.max_lora_rank, dtype)
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        tp = parallel.tensor_parallel_size(mesh)
        slots = lora_layers.shard_slots(slots, mesh, parallel.partition_plan(cfg, tp).specs["layers"])
        owner = jax.device_put(owner, NamedSharding(mesh, PartitionSpec()))
    return {**params, "lora_owner": owner, "layers": {**params["layers"], "lora": slots}}


def _device_of(params) -> jax.Device:
    """The one device a single-device model's params are on (the default device where they are uncommitted)."""
    return next(iter(jax.tree.leaves(params)[0].devices()))


def _head_slices(params, mesh: Mesh | None, pipeline) -> int:
    """The sampler's vocabulary slices (sampler.sample_greedy_in_slices) for this model: on a CPU,
    one device, with a tied float head or a float or per-channel int8 lm_head, whose vocabulary
    splits evenly; else 0 (the whole head)."""
    embed, head = params.get("embed"), params.get("lm_head")
    if (mesh is not None or pipeline is not None or not isinstance(embed, jax.Array) or embed.ndim != 2
            or {d.platform for d in embed.devices()} != {"cpu"}):
        return 0
    return vocab_slices(embed.shape[0]) if head is None or has_columns(head) else 0


def _sampled(so: SamplerOutput, i: int, token_id: int, num_top: int) -> SampledToken:
    """Row i of a fetched SamplerOutput, with the top `num_top` logprobs (None when 0)."""
    top = [(int(a), float(b)) for a, b in zip(so.top_ids[i, :num_top], so.top_logprobs[i, :num_top])]
    return SampledToken(token_id, float(so.logprobs[i]), top or None, int(so.ranks[i]))


def activation_bytes(model: LoadedModel, rc: RunnerConfig) -> int:
    """Temporary device memory of the largest token bucket's step, from XLA's memory analysis of a
    compile against a one-request pool (the activation peak does not grow with the pool)."""
    cfg = model.config
    dtype = rc.kv_dtype(model.params["embed"].dtype)
    blocks = rc.max_blocks_per_seq + 1
    kv = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape in pool_shapes(cfg, blocks, rc.block_size))
    t = step_token_buckets(rc.max_num_batched_tokens)[-1]
    batch, _ = pack(SchedulerOutput(), t, rc.max_num_seqs, rc.max_blocks_per_seq, rc.block_size)
    rows = np.zeros(step_seq_buckets(rc.max_num_seqs)[-1], np.int32)
    prev_tokens = np.zeros(rows.shape, np.int32)
    # a program of its own, dropped after: no executable of this probe stays mapped
    probe = fresh_jit(_model_step_fn, static_argnames=("cfg", "backend", "bf16_dots_from"), donate_argnums=1)
    compiled = probe.lower(model.params, kv, batch, rows, prev_tokens, cfg=cfg, backend=rc.backend,
                                 bf16_dots_from=rc.bf16_dots_from).compile()
    analysis = compiled.memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0
