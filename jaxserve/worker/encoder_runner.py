"""The pooling runner of an encoder (the BERT family): each step one padded [B, S] program of whole
prompts, bidirectional attention inside the step and no KV pool, returning one raw row per request
(the pooled hidden state, or the classifier's logits). LLMEngine runs it as its runner when the
model is an encoder; the scheduler packs its steps (SchedulerConfig.padded_batching).

    SchedulerOutput (padded_shape (B, S)) --pack--> ids, types [B, S], lengths [B]
        --program[(B, S)]--> rows [B, D] (device) --PendingEncoderStep.result()--> ModelOutput.pooled

Every (B, S) of the grid is compiled at warm-up (0 compilations while serving). With a mesh the
weights are split over its `model` axis (column-parallel q/k/v and the MLP's input, row-parallel
attention output and the MLP's output) and XLA inserts the collectives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxserve.core.scheduler_output import ModelOutput, SchedulerOutput
from jaxserve.models import bert
from jaxserve.pooling.pooler import pool_hidden
from jaxserve.worker.programs import num_compilations

# leaf -> its PartitionSpec over (data, model) on a tensor-parallel mesh; leaves not named: replicated
_COLUMN = ("wq", "wk", "wv", "w_in")  # [L, H, out]: split the output
_COLUMN_BIAS = ("bq", "bk", "bv", "b_in")  # [L, out]
_ROW = ("wo", "w_out")  # [L, in, H]: split the input; XLA sums the partial products


def encoder_leaf_spec(path: str) -> PartitionSpec:
    """The PartitionSpec of the encoder leaf at `path` ("layers/wq", "word_embed", "head/dense_w")."""
    group, _, leaf = path.rpartition("/")
    if group == "layers" and leaf in _COLUMN:
        return PartitionSpec(None, None, "model")
    if group == "layers" and leaf in _COLUMN_BIAS:
        return PartitionSpec(None, "model")
    if group == "layers" and leaf in _ROW:
        return PartitionSpec(None, "model", None)
    return PartitionSpec()


def check_tensor_parallel(cfg: bert.EncoderConfig, tp: int) -> None:
    """ValueError naming the flag when the encoder's heads or MLP do not split over `tp` devices."""
    if cfg.num_heads % tp or cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size: {cfg.architecture} has {cfg.num_heads} attention heads and an "
                         f"MLP of {cfg.intermediate_size}; both must divide by {tp}")


def place_on(mesh: Mesh):
    """The loader's per-leaf placer for `mesh` (load_encoder's place_leaf)."""
    return lambda path, arr: jax.device_put(arr, NamedSharding(mesh, encoder_leaf_spec(path)))


def encoder_step(params: bert.Params, token_ids: jax.Array, type_ids: jax.Array, lengths: jax.Array, *,
                 cfg: bert.EncoderConfig, task: str, pooling_type: str, bf16_dots: bool = False) -> jax.Array:
    """[B, S] inputs -> [B, D] f32: embed, the raw pooled hidden state (D = H; the host post-processes:
    Dense, Normalize, Matryoshka); classify, the head's logits (D = num_labels).
    bf16_dots: the projections as bfloat16 dots accumulated in float32 (--dtype auto on a CPU with
    bfloat16 dot instructions)."""
    hidden = bert.encode(params, cfg, token_ids, type_ids, lengths, jnp.bfloat16 if bf16_dots else None)
    if task == "classify":
        return bert.classify(params, cfg, hidden)
    return pool_hidden(hidden, lengths, pooling_type)


@dataclass
class PendingEncoderStep:
    """A dispatched step: `result()` waits for its rows and hands each request its own."""
    out: SchedulerOutput
    rows: jax.Array | None  # [B, D] on the device; None for a step without requests

    def result(self) -> ModelOutput:
        if self.rows is None:
            return ModelOutput()
        rows = np.asarray(self.rows)
        return ModelOutput(pooled={sr.request_id: rows[i] for i, sr in enumerate(self.out.scheduled)})


class EncoderRunner:
    def __init__(self, params: bert.Params, cfg: bert.EncoderConfig, grid: list[tuple[int, int]], *, task: str,
                 pooling_type: str, bf16_dots: bool = False, mesh: Mesh | None = None) -> None:
        self.params, self.cfg, self.grid, self.mesh, self.bf16_dots = params, cfg, grid, mesh, bf16_dots
        self._fn = jax.jit(functools.partial(encoder_step, cfg=cfg, task=task, pooling_type=pooling_type,
                                             bf16_dots=bf16_dots))
        self._programs: dict[tuple[int, int], object] = {}

    def warmup(self, progress: bool = True) -> int:
        """Compile the program of every (B, S) of the grid; returns how many compilations that took."""
        before = num_compilations()
        for rows, seq in tqdm(self.grid, desc="Warm-up (compiling buckets)", unit="program", disable=not progress):
            ids = self._spec((rows, seq))
            self._programs[rows, seq] = self._fn.lower(self.params, ids, ids, self._spec((rows,))).compile()
        return num_compilations() - before

    def _spec(self, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        sharding = NamedSharding(self.mesh, PartitionSpec()) if self.mesh is not None else None
        return jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding)

    def _input(self, arr: np.ndarray) -> jax.Array:
        return jax.device_put(arr, NamedSharding(self.mesh, PartitionSpec()) if self.mesh is not None else None)

    def execute_async(self, out: SchedulerOutput) -> PendingEncoderStep:
        """Pack the step's requests into its padded (B, S) and dispatch its program without waiting."""
        if not out.scheduled:
            return PendingEncoderStep(out, None)
        ids = np.zeros(out.padded_shape, np.int32)
        types = np.zeros_like(ids)
        lens = np.zeros((out.padded_shape[0],), np.int32)
        for i, sr in enumerate(out.scheduled):
            n = len(sr.token_ids)
            ids[i, :n], lens[i] = sr.token_ids, n
            if sr.token_type_ids is not None:
                types[i, :n] = sr.token_type_ids
        program = self._programs.get(out.padded_shape, self._fn)  # (--enforce-eager: compiled on first use)
        return PendingEncoderStep(out, program(self.params, self._input(ids), self._input(types), self._input(lens)))

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        return self.execute_async(out).result()

    def shutdown(self, owns_params: bool = False) -> None:
        if owns_params:
            for x in jax.tree.leaves(self.params):
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
        self._programs, self.params = {}, {}
