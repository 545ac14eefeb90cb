"""The device side of multi-LoRA: adapters in stacked slots, and their product in the jitted step.

Every projection an adapter may target (wq, wk, wv, wo, w_gate, w_up, w_down) gets, inside
params["layers"]["lora"], its slots side by side on the rank axis:

    a  [L, in,  max_loras * max_rank]     slot s (1-based) owns columns (s-1)*R .. s*R
    b  [L, max_loras * max_rank, out]     rows likewise; PEFT's scaling is folded into b

and the step takes a per-token slot index ([T] i32, 0 = the base model). The layer adds

    delta = ((x @ a) * mask) @ b,   mask [T, S*R] = 1 where the column's slot is the token's

(`LoRAStep`, built once per step outside the layer scan). An adapter of rank r < R is
zero-padded, so its extra columns add nothing. Writing a slot is `write_slot`, a
dynamic_update_slice on the donated arrays with a traced offset: one program, compiled in
warm-up, so loading, unloading and swapping adapters never compiles, and any mix of
adapters in a batch is the same program.

Why the one-hot product, measured on this 2-core CPU (XLA, float32, one 576x576
projection, 8 slots of rank 16, random slots; median of 30; the machine was shared):

    tokens   base x@W   one-hot   gather A[slot]   ragged_dot (sorted)
      4        105 us     90 us        41 us           210 us
     64        379 us    237 us       570 us           843 us
    512       8002 us   5248 us     53053 us         16025 us

The gather materialises [T, in, R] per projection (50 MB at 512 tokens) and ragged_dot
on XLA:CPU runs every group over the whole batch plus a sort and scatter; the one-hot
form is two dense matmuls whose cost grows with max_loras * max_rank (keep those to what
the deployment needs) and is the fastest at 64+ tokens, the steps that dominate a busy
server. Steps that take their base projections as bfloat16 dots (the CPU's `--dtype auto`,
llama.run_layers' bf16_dots_from) take the deltas' dots in bfloat16 too: in float32 they had
cost 13-17% of a 128-256-token step of the default model with 8 slots of rank 8, 3-8% as
bfloat16 dots (this CPU, shared, one process side by side).

On GPUs (the Pallas attention backend) a step of at most MAX_ROWS (64) tokens takes each delta
from pallas_kernels/lora_shrink_expand.py instead (Punica's BGMV: each token reads its own
slot's R columns of a and R rows of b, where the one-hot product reads all S * R), for the
projections whose (per-device) shapes it takes; larger steps and other shapes keep the XLA
product. `pallas-interpret` runs the same choice with the kernel in interpret mode (tests).

Tensor parallelism: a and b follow their projection. Column-parallel (q/k/v/gate/up):
a replicated, b split on out; row-parallel (o/down): a split on in, b replicated (the
x @ a partial sums are all-reduced by XLA, as the base projection's are). The kernel, which
has no partitioning rule, runs inside shard_map on each device's shard with the same
splits (row-parallel: a psum of the devices' deltas); a projection kept replicated (heads
that do not split) is sliced there, which is correct and costs an all-gather of the delta.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.lora.peft import LoRAWeights, module_dims
from jaxserve.models.config import ModelConfig
from jaxserve.quantization.matmul import model_mesh
from pallas_kernels import lora_shrink_expand as kernel

MODEL_AXIS = "model"
ROW_PARALLEL = ("wo", "w_down")  # a split on its input under tensor parallelism; the others split b's output

LoRAParams = dict[str, dict[str, jax.Array]]  # module -> {"a": [L, in, S*R], "b": [L, S*R, out]}


def init_slots(cfg: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32) -> tuple[LoRAParams, jax.Array]:
    """Every slot empty (zeros), and the owner of each column: [S, R] i32, the 1-based slot (the
    model's params["lora_owner"], which `slot_mask` compares the tokens' slots with; its shape
    gives the step the slots' rank statically)."""
    width = max_loras * max_rank
    lora = {m: {"a": jnp.zeros((cfg.num_layers, n_in, width), dtype),
                "b": jnp.zeros((cfg.num_layers, width, n_out), dtype)}
            for m, (n_in, n_out) in module_dims(cfg).items()}
    return lora, (jnp.arange(width, dtype=jnp.int32) // max_rank + 1).reshape(max_loras, max_rank)


def slot_specs(modules, layer_specs: dict) -> dict[str, dict[str, P]]:
    """Each module's a and b PartitionSpecs: with their projection's split (see the module docstring);
    a projection whose spec is not a plain model-axis split (replicated, or kv-head groups) keeps
    its LoRA replicated."""
    out = {}
    for m in modules:
        spec = tuple(layer_specs.get(m, P()))
        col = len(spec) == 3 and spec[2] == MODEL_AXIS and spec[1] is None
        row = len(spec) == 3 and spec[1] == MODEL_AXIS and spec[2] is None
        out[m] = {"a": P(None, MODEL_AXIS, None) if row else P(), "b": P(None, None, MODEL_AXIS) if col else P()}
    return out


def shard_slots(lora: LoRAParams, mesh, layer_specs: dict) -> LoRAParams:
    """Place a and b over `mesh` as `slot_specs` says."""
    specs = slot_specs(lora, layer_specs)
    return {m: {k: jax.device_put(v, NamedSharding(mesh, specs[m][k])) for k, v in ab.items()}
            for m, ab in lora.items()}


def padded(weights: LoRAWeights | None, cfg: ModelConfig, max_rank: int) -> dict[str, dict[str, np.ndarray]]:
    """One slot's contents on the host: every module, A [L, in, R] and B [L, R, out], zero-padded
    (None or an untargeted module: zeros, so a reused slot keeps nothing of its last adapter)."""
    out = {}
    for m, (n_in, n_out) in module_dims(cfg).items():
        a = np.zeros((cfg.num_layers, n_in, max_rank), np.float32)
        b = np.zeros((cfg.num_layers, max_rank, n_out), np.float32)
        if weights is not None and m in weights.modules:
            wa, wb = weights.modules[m]
            a[:, :, :wa.shape[2]], b[:, :wb.shape[1], :] = wa, wb
        out[m] = {"a": a, "b": b}
    return out


@functools.partial(jax.jit, donate_argnums=0)
def write_slot(lora: LoRAParams, new: LoRAParams, start: jax.Array) -> LoRAParams:
    """`new` (each module's a [L, in, R], b [L, R, out]) into columns/rows start .. start+R of the
    stacked arrays; start is traced: one program for every slot."""
    zero = jnp.zeros((), jnp.int32)
    return {m: {"a": jax.lax.dynamic_update_slice(ab["a"], new[m]["a"].astype(ab["a"].dtype), (zero, zero, start)),
                "b": jax.lax.dynamic_update_slice(ab["b"], new[m]["b"].astype(ab["b"].dtype), (zero, start, zero))}
            for m, ab in lora.items()}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRAStep:
    """A step's adapters, as every layer reads them."""
    slots: jax.Array  # [T] i32: each token's slot (0: the base model, and padding)
    mask: jax.Array  # [T, S*R] f32: the XLA path's one-hot over the slots' columns
    rank: int = field(metadata=dict(static=True))  # R, every slot's (padded) rank
    kernel: str = field(default="", metadata=dict(static=True))  # "", "pallas" or "interpret"


def step_inputs(slots: jax.Array, owner: jax.Array, kernel: str = "") -> LoRAStep:
    """slots [T] i32, owner [S, R] i32 (params["lora_owner"]); kernel: "pallas" (GPUs) or
    "interpret" to take decode-sized deltas from the Pallas kernel, "" for the XLA path only."""
    if kernel not in ("", "pallas", "interpret"):
        raise ValueError(f"kernel must be '', 'pallas' or 'interpret'; got {kernel!r}")
    return LoRAStep(slots, slot_mask(slots, owner), owner.shape[-1], kernel)


def slot_mask(slots: jax.Array, owner: jax.Array) -> jax.Array:
    """slots [T] i32 (0: base model), owner [S*R] or [S, R] i32 -> mask [T, S*R] f32: 1 on the token's slot's
    columns."""
    return (slots[:, None] == owner.reshape(1, -1)).astype(jnp.float32)


def delta(x: jax.Array, ab: dict[str, jax.Array], step: LoRAStep | jax.Array, name: str = "",
          dots: jnp.dtype | None = None) -> jax.Array:
    """x [T, in] -> the adapters' contribution [T, out] (shrink, select the token's slot, expand).
    step: the step's LoRAStep (or its bare mask [T, S*R]: the XLA path); name: the projection;
    dots: the XLA path's operands in that dtype, accumulated in float32 (as the base projections'
    in the same step: llama.run_layers' bf16_dots_from)."""
    if isinstance(step, LoRAStep):
        if step.kernel and x.shape[0] <= kernel.MAX_ROWS:
            out = kernel_delta(x, ab, step, name)
            if out is not None:
                return out
        step = step.mask
    a, b = ab["a"], ab["b"]
    if dots is not None:
        a, b = a.astype(dots), b.astype(dots)
    shrunk = jnp.dot(x.astype(a.dtype), a, preferred_element_type=jnp.float32) * step
    return jnp.dot(shrunk.astype(b.dtype), b, preferred_element_type=jnp.float32).astype(x.dtype)


def kernel_delta(x: jax.Array, ab: dict[str, jax.Array], step: LoRAStep, name: str) -> jax.Array | None:
    """The Pallas kernel's delta [T, out], on each device's shard under tensor parallelism (see the
    module docstring); None where the (per-device) shapes are not the kernel's."""
    a, b = ab["a"], ab["b"]
    (k, n), interpret = (a.shape[0], b.shape[1]), step.kernel == "interpret"

    def local(x, slots, a, b):
        return kernel.lora_shrink_expand(x.astype(a.dtype), slots, a, b, rank=step.rank, interpret=interpret)

    mesh = model_mesh(a, MODEL_AXIS)
    if mesh is None:
        return local(x, step.slots, a, b).astype(x.dtype) if kernel.supported(k, n, step.rank) else None
    tp = mesh.shape[MODEL_AXIS]
    if name in ROW_PARALLEL:
        if k % tp or not kernel.supported(k // tp, n, step.rank):
            return None
        body = lambda *args: jax.lax.psum(local(*args), MODEL_AXIS)  # noqa: E731
        specs, out_spec = (P(None, MODEL_AXIS), P(), P(MODEL_AXIS, None), P()), P()
    else:
        if n % tp or not kernel.supported(k, n // tp, step.rank):
            return None
        body, specs, out_spec = local, (P(), P(), P(), P(None, MODEL_AXIS)), P(None, MODEL_AXIS)
    # (check_vma off: a pallas_call's output does not say how it varies over the mesh)
    out = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)(x, step.slots, a, b)
    return out.astype(x.dtype)


def add(y: jax.Array, lp: dict, name: str, x: jax.Array, step: LoRAStep | None,
        dots: jnp.dtype | None = None) -> jax.Array:
    """The model's hook: y (the projection of x by lp[name]) plus its LoRA delta, when the step has adapters."""
    if step is None or name not in lp.get("lora", {}):
        return y
    return y + delta(x, lp["lora"][name], step, name, dots)
