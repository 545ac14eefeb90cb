"""The device side of multi-LoRA: adapters in stacked slots, and their product in the jitted step.

Every projection an adapter may target (wq, wk, wv, wo, w_gate, w_up, w_down) gets, inside
params["layers"]["lora"], its slots side by side on the rank axis:

    a  [L, in,  max_loras * max_rank]     slot s (1-based) owns columns (s-1)*R .. s*R
    b  [L, max_loras * max_rank, out]     rows likewise; PEFT's scaling is folded into b

and the step takes a per-token slot index ([T] i32, 0 = the base model). The layer adds

    delta = ((x @ a) * mask) @ b,   mask [T, S*R] = 1 where the column's slot is the token's

(`slot_mask`, built once per step outside the layer scan). An adapter of rank r < R is
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
server. (pallas_kernels/lora_shrink_expand.py is a Pallas shrink/expand kernel for GPU decode
sizes, tested in interpret mode and lowered for cuda; the step does not call it yet.)

Tensor parallelism: a and b follow their projection. Column-parallel (q/k/v/gate/up):
a replicated, b split on out; row-parallel (o/down): a split on in, b replicated (the
x @ a partial sums are all-reduced by XLA, as the base projection's are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.lora.peft import LoRAWeights, module_dims
from jaxserve.models.config import ModelConfig

LoRAParams = dict[str, dict[str, jax.Array]]  # module -> {"a": [L, in, S*R], "b": [L, S*R, out]}


def init_slots(cfg: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32) -> tuple[LoRAParams, jax.Array]:
    """Every slot empty (zeros), and the owner of each column: [S*R] i32, the 1-based slot (the
    model's params["lora_owner"], which `slot_mask` compares the tokens' slots with)."""
    width = max_loras * max_rank
    lora = {m: {"a": jnp.zeros((cfg.num_layers, n_in, width), dtype),
                "b": jnp.zeros((cfg.num_layers, width, n_out), dtype)}
            for m, (n_in, n_out) in module_dims(cfg).items()}
    return lora, jnp.arange(width, dtype=jnp.int32) // max_rank + 1


def shard_slots(lora: LoRAParams, mesh, layer_specs: dict) -> LoRAParams:
    """Place a and b with their projection's split (see the module docstring); a projection whose
    spec is not a plain model-axis split (replicated, or kv-head groups) keeps its LoRA replicated."""
    out = {}
    for m, ab in lora.items():
        spec = tuple(layer_specs.get(m, P()))
        col = len(spec) == 3 and spec[2] == "model" and spec[1] is None
        row = len(spec) == 3 and spec[1] == "model" and spec[2] is None
        sa = P(None, "model", None) if row else P()
        sb = P(None, None, "model") if col else P()
        out[m] = {"a": jax.device_put(ab["a"], NamedSharding(mesh, sa)),
                  "b": jax.device_put(ab["b"], NamedSharding(mesh, sb))}
    return out


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


def slot_mask(slots: jax.Array, owner: jax.Array) -> jax.Array:
    """slots [T] i32 (0: base model), owner [S*R] i32 -> mask [T, S*R] f32: 1 on the token's slot's columns."""
    return (slots[:, None] == owner[None, :]).astype(jnp.float32)


def delta(x: jax.Array, ab: dict[str, jax.Array], mask: jax.Array) -> jax.Array:
    """x [T, in] -> the adapters' contribution [T, out] (shrink, select the token's slot, expand)."""
    a, b = ab["a"], ab["b"]
    shrunk = jnp.dot(x.astype(a.dtype), a, preferred_element_type=jnp.float32) * mask
    return jnp.dot(shrunk.astype(b.dtype), b, preferred_element_type=jnp.float32).astype(x.dtype)


def add(y: jax.Array, lp: dict, name: str, x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The model's hook: y (the projection of x by lp[name]) plus its LoRA delta, when the step has adapters."""
    if mask is None or name not in lp.get("lora", {}):
        return y
    return y + delta(x, lp["lora"][name], mask)
