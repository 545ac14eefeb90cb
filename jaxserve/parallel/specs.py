"""Which axis of each weight and of the KV pool is split over the mesh's "model" axis.

Megatron-style tensor parallelism expressed as PartitionSpecs; XLA inserts the
collectives (an all-reduce after each row-parallel matmul, and around the
vocabulary-split embedding and LM head):

    x [T, hidden] replicated
      -> wq/wk/wv, w_gate/w_up  [L, in, out]  column-parallel: out split  -> heads / inter local
      -> wo, w_down             [L, in, out]  row-parallel:    in split   -> partial sums, all-reduce
    embed [vocab, hidden], lm_head [hidden, vocab]: vocabulary split
    norms, q_norm/k_norm: replicated; the leading layer axis is never split

q/k/v split only on whole heads. When the kv heads are fewer than the model axis
(and divide it), each kv head is kept by a group of neighbouring devices -- the
"replicated groups" of vLLM -- expressed on a second view of the same devices,
the kv mesh ("data", "kv_heads", "kv_replica"):

    tp = 4, num_kv_heads = 2, num_heads = 8:
      model axis     d0  d1  d2  d3      q heads 0-1 | 2-3 | 4-5 | 6-7
      kv_heads axis  [d0  d1][d2  d3]    kv head 0 on d0, d1; kv head 1 on d2, d3

Any other leaf whose split dimension does not divide evenly falls back to
replication, and the reason is recorded (see `partition_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import param_shapes
from jaxserve.parallel.mesh import DATA_AXIS, MODEL_AXIS

REPLICATED = P()
KV_HEADS_AXIS = "kv_heads"  # axis of the kv mesh: one entry per kv head (replicated groups)
KV_REPLICA_AXIS = "kv_replica"  # the devices sharing one kv head


@dataclass(frozen=True)
class PartitionPlan:
    specs: dict  # same tree as llama.param_shapes(cfg), PartitionSpec leaves
    kv_cache: P  # for each of K and V, [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    notes: dict[str, str] = field(default_factory=dict)  # leaf path -> why it is replicated / grouped
    kv_groups: int = 0  # > 0: specs naming KV_HEADS_AXIS live on kv_group_mesh(mesh, kv_groups)


def kv_group_mesh(mesh: Mesh, kv_groups: int) -> Mesh:
    """The same devices as `mesh`, its model axis viewed as (kv_heads=kv_groups, kv_replica)."""
    dp, tp = mesh.devices.shape
    grid = np.asarray(mesh.devices).reshape(dp, kv_groups, tp // kv_groups)
    return Mesh(grid, (DATA_AXIS, KV_HEADS_AXIS, KV_REPLICA_AXIS))


def mesh_for(mesh: Mesh, spec: P, plan: PartitionPlan) -> Mesh:
    """The mesh a spec of `plan` refers to: the kv mesh for replicated-group specs."""
    return kv_group_mesh(mesh, plan.kv_groups) if KV_HEADS_AXIS in tuple(spec) else mesh


def _column(ndim: int, axis: str = MODEL_AXIS) -> P:  # [L, in, out] or bias [L, out]: split the last dim
    return P(*([None] * (ndim - 1)), axis)


def _row() -> P:  # [L, in, out]: split the input dim
    return P(None, MODEL_AXIS, None)


def partition_plan(cfg: ModelConfig, tensor_parallel_size: int) -> PartitionPlan:
    """The PartitionSpec of every param leaf and of the KV pool, plus why any leaf fell back to replication."""
    tp = tensor_parallel_size
    shapes = param_shapes(cfg)
    notes: dict[str, str] = {}
    if tp == 1:
        return PartitionPlan(_tree_like(shapes, REPLICATED), REPLICATED)

    q_ok = cfg.num_heads % tp == 0
    kv_ok = q_ok and cfg.num_kv_heads % tp == 0
    kv_groups = cfg.num_kv_heads if q_ok and not kv_ok and tp % cfg.num_kv_heads == 0 else 0
    kv_axis = KV_HEADS_AXIS if kv_groups else MODEL_AXIS
    mlp_ok = cfg.intermediate_size % tp == 0
    vocab_ok = cfg.vocab_size % tp == 0
    why_q = f"num_heads {cfg.num_heads} not divisible by tensor parallel size {tp}"
    why_kv = (why_q if not q_ok else
              f"num_kv_heads {cfg.num_kv_heads} not divisible by tensor parallel size {tp}")
    why_mlp = f"intermediate_size {cfg.intermediate_size} not divisible by {tp}"
    why_vocab = f"vocab_size {cfg.vocab_size} not divisible by {tp}"

    rules: dict[str, tuple[bool, P, str]] = {
        "wq": (q_ok, _column(3), why_q), "bq": (q_ok, _column(2), why_q), "wo": (q_ok, _row(), why_q),
        "wk": (kv_ok or kv_groups, _column(3, kv_axis), why_kv),
        "wv": (kv_ok or kv_groups, _column(3, kv_axis), why_kv),
        "bk": (kv_ok or kv_groups, _column(2, kv_axis), why_kv),
        "bv": (kv_ok or kv_groups, _column(2, kv_axis), why_kv),
        "w_gate": (mlp_ok, _column(3), why_mlp), "w_up": (mlp_ok, _column(3), why_mlp),
        "w_down": (mlp_ok, _row(), why_mlp),
        **registry.get_family(cfg.architecture).partition_rules(cfg, tp),  # a family's own leaves
    }
    layers = {}
    for leaf in shapes["layers"]:
        ok, spec, why = rules.get(leaf, (False, REPLICATED, ""))
        layers[leaf] = spec if ok else REPLICATED
        if why and not ok:
            notes[f"layers/{leaf}"] = f"replicated: {why}"
    specs = {"embed": P(MODEL_AXIS, None) if vocab_ok else REPLICATED, "layers": layers,
             "final_norm": REPLICATED}
    if "lm_head" in shapes:
        specs["lm_head"] = P(None, MODEL_AXIS) if vocab_ok else REPLICATED
    if not vocab_ok:
        notes.update({k: f"replicated: {why_vocab}" for k in ("embed", "lm_head") if k in shapes})
    kv_spec = P(None, kv_axis, None, None, None) if kv_ok or kv_groups else REPLICATED
    if kv_groups:
        group = (f"replicated groups: {cfg.num_kv_heads} kv heads < tensor parallel size {tp}, "
                 f"each kv head on {tp // kv_groups} devices")
        notes.update({f"layers/{k}": group for k in ("wk", "wv", "bk", "bv") if k in layers})
        notes["kv_cache"] = group
    elif not kv_ok:
        notes["kv_cache"] = f"replicated: {why_kv}"
    if cfg.mla is not None:  # one latent per token shared by all heads: every device holds it (vLLM, sglang)
        kv_spec, kv_groups = REPLICATED, 0
        notes["kv_cache"] = "replicated: the latent pool (multi-head latent attention) is shared by all heads"
    return PartitionPlan(specs, kv_spec, notes, kv_groups)


def param_partition_specs(cfg: ModelConfig, tensor_parallel_size: int) -> dict:
    """A pytree of PartitionSpec matching `llama.param_shapes(cfg)`."""
    return partition_plan(cfg, tensor_parallel_size).specs


def kv_cache_partition_spec(cfg: ModelConfig, tensor_parallel_size: int) -> P:
    """Kv-head axis (axis 1) of [L, Hkv, NB, BS, D] split when divisible, else replicated."""
    return partition_plan(cfg, tensor_parallel_size).kv_cache


def _tree_like(tree: dict, value: P) -> dict:
    return {k: _tree_like(v, value) if isinstance(v, dict) else value for k, v in tree.items()}
