"""Pipeline parallelism: the layers split into P contiguous stages, each on its own TP sub-mesh.

    devices d0 .. d(tp*pp-1)       stage s: mesh ("data"=1, "model"=tp) of d[s*tp : (s+1)*tp]
    stage 0     embed + layers [0, a)        K, V [a, kv_heads, blocks, block_size, head_dim]
    stage s     layers [a_s, a_s+1)          its own slice of the pool (same block ids everywhere)
    stage P-1   layers [.., L) + final norm + LM head (a tied model's embedding copy)

One model step runs stage by stage: each stage is one jitted program on its sub-mesh (its
layers `lax.scan`ned, its pool donated), and the residual stream [T, hidden] goes to the next
stage by `jax.device_put` onto that stage's devices -- JAX's own transfer, no hand-written
transport. Dispatch is asynchronous, so the host has issued every stage before the first has
finished; the sampler then runs on the last stage's devices with its params. The layer split is
parallel/stages.py's `stage_layer_ranges` (uneven counts: the extra layers in the middle stages),
the same one `jaxserve plan` sizes. Within tensor parallelism each stage is split as usual
(parallel/specs.py); the scheduler does not know about stages.

Stages on several hosts (jax.distributed, a stage per host as over Ethernet): every process
issues every stage's program, and a process holding none of a stage's devices skips its
work. JAX cannot `device_put` between processes on every backend (not on the CPU), so there
the residual stream moves by a `shard_map` program over the two stages' devices whose
`ppermute` is the transfer (NCCL on GPUs, gloo on CPUs), and the sampler's outputs are
all-gathered onto every stage, so that rank 0 (stage 0) reads what the last stage sampled.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.models import layer_kinds, llama
from jaxserve.models.config import ModelConfig
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.sharding import ModelShardings, make_sharded_kv_cache
from jaxserve.parallel.jit import fresh_jit
from jaxserve.parallel.stages import stage_layer_ranges


def _stage_step_fn(params, kv, h, batch, rows, prev_tokens, *, cfg, backend, first, last):
    """One stage: tokens (first) or the previous stage's h [T, hidden] through its layers; the last
    stage also returns the final-normed rows [P, hidden] and all positions [T, hidden].
    prev_tokens [P] i32: the previous step's sampled ids (async scheduling), as model_runner's step."""
    if first:
        token_ids = jnp.where(batch.prev_rows >= 0, prev_tokens[jnp.maximum(batch.prev_rows, 0)], batch.token_ids)
        h = llama.embed(params, cfg, token_ids)
    kv, h = llama.run_layers(params["layers"], cfg, kv, h, batch.positions, batch.attn, backend)
    if last:
        h = llama.final_hidden(params, cfg, h)
        return kv, h[rows], h
    return kv, h


def split_params(params: dict, cfg: ModelConfig, ranges: Sequence[tuple[int, int]]) -> list[dict]:
    """Each stage's subtree: its slice of the stacked layers, the embedding on the first, the final
    norm and LM head on the last (tied embeddings: the embedding, used as the head)."""
    stages = []
    for s, (a, b) in enumerate(ranges):
        sp: dict = {"layers": layer_kinds.slice_layers(cfg, params["layers"], a, b)}  # a mixed MoE: each kind's rows
        if s == 0:
            sp["embed"] = params["embed"]
        if s == len(ranges) - 1:
            sp["final_norm"] = params["final_norm"]
            sp["lm_head" if "lm_head" in params else "embed"] = params.get("lm_head", params["embed"])
        stages.append(sp)
    return stages


@dataclass
class Pipeline:
    cfg: ModelConfig
    ranges: list[tuple[int, int]]
    meshes: list[Mesh]
    params: list[dict]  # stage s's params, on meshes[s]
    backend: str = "xla"
    # this pipeline's own stage program (worker/programs.py: an engine owns its executables)
    stage_step: object = dataclasses.field(default_factory=lambda: fresh_jit(
        _stage_step_fn, static_argnames=("cfg", "backend", "first", "last"), donate_argnums=1))

    def release(self) -> None:
        """Free the stages' params and the stage program's executables (the engine is closing)."""
        for x in jax.tree.leaves(self.params):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        self.params = []
        self.stage_step.clear_cache()
        self.stage_step = None

    @property
    def stage_configs(self) -> list[ModelConfig]:
        return [layer_kinds.stage_config(self.cfg, a, b) for a, b in self.ranges]

    @property
    def sampler_params(self) -> dict:
        """The last stage's params: the LM head (or tied embedding) the sampler multiplies by."""
        return self.params[-1]

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype) -> tuple[jax.Array, ...]:
        """(K0, V0, K1, V1, ...): each stage's pool on its own devices, flat so that the block copy
        programs (which map over a tuple of pools) treat every stage alike."""
        pools = [make_sharded_kv_cache(m, c, num_blocks, block_size, dtype)
                 for m, c in zip(self.meshes, self.stage_configs)]
        return tuple(x for pool in pools for x in pool)

    @functools.cached_property
    def multi_process(self) -> bool:
        """The stages span several processes (jax.distributed): transfers go through collectives."""
        return len({d.process_index for m in self.meshes for d in m.devices.flat}) > 1

    def to_stage(self, x, s: int):
        """`x` (host data, or an array replicated on another stage's devices) onto stage s's devices."""
        replicated = NamedSharding(self.meshes[s], P())
        if not self.multi_process or not isinstance(x, jax.Array):
            return jax.device_put(x, replicated)
        src = next(i for i, m in enumerate(self.meshes) if set(m.devices.flat) == set(x.sharding.device_set))
        return _hop(x, self.meshes[src], self.meshes[s])

    def publish(self, tree):
        """The last stage's outputs replicated onto every stage's devices, so every process (rank 0
        above all) reads them locally; as is within one process."""
        if not self.multi_process:
            return tree
        return jax.tree.map(lambda x: _all_stages(x, self.meshes), tree)

    def per_stage(self, fn):
        """`fn(pool, *args) -> pool` (a block copy) applied to each stage's (K, V) on its own devices."""
        def apply(kv: tuple[jax.Array, ...], *args) -> tuple[jax.Array, ...]:
            return tuple(x for s in range(len(self.ranges)) for x in fn((kv[2 * s], kv[2 * s + 1]), *args))
        return apply

    def step(self, params, kv: tuple[jax.Array, ...], batch, rows, prev_tokens):
        """The model step over all stages: (kv, hidden rows [P, hidden], hidden [T, hidden]).
        `params` is ignored (the stages hold theirs); the signature is model_runner's step's."""
        del params
        if not np.any(batch.prev_rows >= 0):  # no id from the sampler: stage 0 must not wait for it
            prev_tokens = np.zeros(prev_tokens.shape, np.int32)
        new_kv: list[jax.Array] = []
        h = None
        last = len(self.ranges) - 1
        for s, (sp, cfg) in enumerate(zip(self.params, self.stage_configs)):
            if h is not None:  # the residual stream to this stage's devices
                h = self.to_stage(h, s)
            else:  # the last sampled ids come from the sampler, on the last stage's devices
                prev_tokens = self.to_stage(prev_tokens, s)
            out = self.stage_step(sp, (kv[2 * s], kv[2 * s + 1]), h, batch, rows, prev_tokens, cfg=cfg, backend=self.backend,
                              first=s == 0, last=s == last)
            new_kv += out[0]
            h = out[1]
        return tuple(new_kv), out[1], out[2]


def build_pipeline(params: dict, cfg: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int,
                   devices: Sequence[jax.Device] | None = None, backend: str = "xla") -> Pipeline:
    """Split `params` (host or device arrays) into stages placed on their sub-meshes."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    devices = list(jax.devices() if devices is None else devices)
    if tp * pp > len(devices):
        raise ValueError(f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} needs {tp * pp} devices "
                         f"but only {len(devices)} are visible")
    ranges = stage_layer_ranges(cfg.num_layers, pp)
    meshes = [make_mesh(tp, 1, devices[s * tp:(s + 1) * tp]) for s in range(pp)]
    placed = []
    for sp, mesh, (a, b) in zip(split_params(params, cfg, ranges), meshes, ranges):
        if tp == 1:  # any tree (quantized leaves too) on the stage's one device (maybe another process's)
            one = mesh.devices.flat[0]
            placed.append(jax.device_put(sp, one if one.process_index == jax.process_index()
                                         else NamedSharding(mesh, P())))
            continue
        shardings = ModelShardings.create(mesh, dataclasses.replace(cfg, num_layers=b - a), sp).params  # packed leaves too
        placed.append(jax.device_put(sp, {k: shardings[k] for k in sp}))
    return Pipeline(cfg, ranges, meshes, placed, backend)


# ---- transfers between processes ------------------------------------------------------------------
# A stage's array replicated on its tp devices becomes one block of a [S * n, ...] array over a
# (stage, model) mesh of the stages' devices; devices with nothing to send give zeros. One
# collective moves the blocks; each process supplies and keeps only its own devices' shards.

def _stacked(x: jax.Array, mesh: Mesh, src_devices: set) -> jax.Array:
    """`x` (replicated on `src_devices`) as block `src` of a [S * n, ...] array sharded on "stage"."""
    own = {s.device: s.data for s in x.addressable_shards}
    shards = [own[d] if d in src_devices else _zeros(x.shape, x.dtype, d)
              for d in mesh.devices.flat if d.process_index == jax.process_index()]
    shape = (mesh.shape["stage"] * x.shape[0], *x.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P("stage")), shards, dtype=x.dtype)


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype, device: jax.Device) -> jax.Array:
    """What a device with nothing to send contributes (one per bucket shape, made once)."""
    return jax.device_put(np.zeros(shape, dtype), device)


@functools.lru_cache(maxsize=None)
def _union_mesh(meshes: tuple[Mesh, ...]) -> Mesh:
    return Mesh(np.stack([m.devices.reshape(-1) for m in meshes]), ("stage", "model"))


@functools.lru_cache(maxsize=None)
def _hop_program(mesh: Mesh):
    body = functools.partial(jax.lax.ppermute, axis_name="stage", perm=[(0, 1)])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage")))


def _replicated(x: jax.Array, mesh: Mesh) -> jax.Array:
    return x if x.sharding.is_fully_replicated else jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))(x)


def _hop(x: jax.Array, src: Mesh, dst: Mesh) -> jax.Array:
    """`x` on `src`'s devices -> replicated on `dst`'s: one ppermute from src to dst."""
    mesh, x = _union_mesh((src, dst)), _replicated(x, src)
    moved = _hop_program(mesh)(_stacked(x, mesh, set(src.devices.flat)))
    dst_devices = set(dst.devices.flat)
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(dst, P()), [s.data for s in moved.addressable_shards if s.device in dst_devices],
        dtype=x.dtype)


@functools.lru_cache(maxsize=None)
def _gather_program(mesh: Mesh, src: int):
    def body(block):
        return jax.lax.all_gather(block, "stage")[src]
    # (the gathered block is the same on every stage; JAX does not infer that through the indexing)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P(), check_vma=False))


def _all_stages(x: jax.Array, meshes: list[Mesh]) -> jax.Array:
    """`x` on the last stage's devices -> replicated on every stage's: one all-gather."""
    mesh, x = _union_mesh(tuple(meshes)), _replicated(x, meshes[-1])
    return _gather_program(mesh, len(meshes) - 1)(_stacked(x, mesh, set(meshes[-1].devices.flat)))


def host_params(params: dict) -> dict:
    """Device params to host numpy, to be split without a whole copy staying on one device."""
    return jax.tree.map(np.asarray, params)

