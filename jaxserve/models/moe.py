"""The Mixture-of-Experts block: route each token to its top-k experts, run only those rows.

    x [T, H] --router--> ids [T, k] i32, weights [T, k] f32
      T*k <= GATHER_MAX_ROWS   gather: each (token, choice) row multiplies its own expert's
                               weights, gathered by id: only touched experts are ever read
      otherwise                sort: the T*k rows sorted by expert (group_sizes [E]); a batched
                               SwiGLU over E x capacity C slots, in rounds of C rows per expert
                               until the largest group is done (nothing is dropped)
    y [T, k, H] -> sum_k weights * y -> [T, H]

`expert_swiglu` is the one place the path is chosen. With the Pallas backend (GPU: the step's
`backend`, as attention's) every size takes the grouped path instead: the T*k rows sorted by
expert, then gate, up and down as three grouped matmuls (expert_weights.grouped_matmul: the
Pallas Triton kernel pallas_kernels/grouped_matmul.py, lhs [M, K] sorted by group, rhs
[E, K, N], group_sizes [E] -> [M, N]; a static grid of cdiv(M, 16) + min(E, M) row blocks, one
expert each, so its cost follows the touched experts). The gather and sorted paths below are
lax.map loops of small dots: right for XLA:CPU, a sequence of tiny kernels on a GPU.

Expert weights may be packed (expert_weights.py: block-wise fp8 QuantizedWeight, Mxfp4Weight):
every path dequantizes only the experts it multiplies by, inside the program.

Why these paths (XLA:CPU, jax 0.10, a shared 2-core Xeon, scripts/bench_moe.py: 128 experts of
H = 512 -> I = 192, top-8 -- Qwen3-30B-A3B's proportions -- float32, ratios side by side in one run):
  * `jax.lax.ragged_dot` is lowered on the CPU as a masked dense product per expert over all rows:
    7.9 s at 256 tokens against 0.16 s for the sorted path, 250x slower at 1 token. Not used.
  * one batched dot over [E, C, H] x [E, H, I] (capacity buffers) ran 3-6x slower than a loop of
    per-expert dots here (XLA:CPU's batched dot does not tile well at small C), so each path is a
    `lax.map` of plain 2D dots: over the T*k rows (gather) or over the experts (sorted), with a
    `lax.cond` skipping an expert that has no rows (its weights are never read).
  * the gather path reads only the chosen experts (1.4 ms at 1 token, 6 ms at 4; the sorted
    path's loop over all experts cost 1.2 and 20 ms there), so T*k <= 32 rows take it.
  * capacity C = 2 * T*k / E (a power of two, at most T): a balanced batch finishes in one
    round; an unbalanced one pays one more loop per further C rows of its largest group, never
    a dropped token (a `while_loop`, exact).
  * the gather path's floor on XLA:CPU is the stacks' layout, not the loop. Over [E, K, N] each row's
    `w[e]` dynamic slice is copied out (a loop fusion) before the library's dot, so every chosen
    expert is read, written and read again: 1.6-2.1x the dense active-width layer at 1 token. Stored
    output-major, [E, N, K] (nn.Linear's per-expert [out, in]), `row @ w[e].T` compiles to one
    fusion of slice, transpose and vector-matrix dot (each expert read once): 0.8-1.1x of it, in the
    same runs (bench_moe.py's `gather_oi` column). Not the engine's layout yet: the loader,
    expert_weights' forms, the TP/EP specs and the Pallas kernel all take [E, K, N], and the sorted
    path's [C, H] dots run 1.1-1.5x slower over [E, N, K] (16-256 tokens; the gather path over it
    beats them up to ~16 tokens). Measured and no better over [E, K, N]: gate|up fused into one
    [E, H, 2I] stack (one copy and dot per row), a 1-D row, `W^T x` order, an unrolled Python loop over
    the rows, multiply-and-sum in place of the dots (any layout), one gather of all k experts then a
    batched einsum, a `lax.switch` over E static slices. bfloat16 dots do not apply: the engine's
    CPU default takes them from 64 tokens up (engine/config.py, bf16_dots_from), float32 below.
Against the bounds (BENCHMARKS.md, "MoE layer"): 2.1-2.8x of reading each touched expert once plus
the active FLOPs at 16-256 tokens (1.0-1.8x on a busier machine); 2-3x the dense layer of the active
width at 1 token. 4 tokens touch 29 of 128 experts, 3.6x the active weights: reading them once at 1
row alone costs ~2.7x the dense active-width layer, so 1.5x of it there is out of reach for any path
that reads each touched expert.

Expert parallelism (`--enable-expert-parallel`): the expert axis is split over the mesh's
"model" axis; every device sees every token (x replicated), keeps the rows routed to its own
experts (others get weight 0 and are sorted past the last group), and one `psum` adds the
devices' partial sums (shard_map; the mesh is the jit's own, read from the weights' avals).
Without the flag, on the Pallas backend, the same shard_map runs each device's slice of every
expert's intermediate axis (`_intermediate_split`): XLA cannot partition a Pallas kernel itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.models.attention import PALLAS_BACKENDS
from jaxserve.models.expert_weights import (ExpertWeight, expert_weight, first_leaf,
                                            grouped_matmul, is_packed)
from jaxserve.models.expert_weights import num_experts as stack_size
from jaxserve.quantization.matmul import matmul

GATHER_MAX_ROWS = 32  # T * k at or below which the gather path runs (decode of a few sequences)
MODEL_AXIS = "model"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Experts:
    """The stacked weights of E experts (SwiGLU), as one layer sees them (float, or packed:
    expert_weights.py); a family's variations are optional biases and its own gated activation
    (gpt-oss: both)."""
    w_gate: ExpertWeight  # [E, H, I]
    w_up: ExpertWeight  # [E, H, I]
    w_down: ExpertWeight  # [E, I, H]
    b_gate: jax.Array | None = None  # [E, I]
    b_up: jax.Array | None = None  # [E, I]
    b_down: jax.Array | None = None  # [E, H]
    # (gate [C, I], up [C, I]) -> [C, I]; None: silu(gate) * up. Static: hashable, compared by value.
    activation: Callable[[jax.Array, jax.Array], jax.Array] | None = field(default=None, metadata=dict(static=True))

    def act(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return jax.nn.silu(gate) * up if self.activation is None else self.activation(gate, up)

    @property
    def num_experts(self) -> int:
        return stack_size(self.w_gate)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Router:
    weight: jax.Array  # [H, E]
    bias: jax.Array | None = None  # [E]
    top_k: int = field(default=1, metadata=dict(static=True))
    norm_topk_prob: bool = field(default=False, metadata=dict(static=True))
    kind: str = field(default="softmax_topk", metadata=dict(static=True))  # see config.MoeConfig.router


def route(x: jax.Array, router: Router, dots: jnp.dtype | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, H] -> expert ids [T, k] i32 and routing weights [T, k] f32 (as transformers: the
    logits in x's dtype, the softmax in float32)."""
    logits = matmul(x, router.weight, dots)
    if router.bias is not None:
        logits = logits + router.bias
    logits = logits.astype(jnp.float32)
    if router.kind == "topk_softmax":
        top, ids = jax.lax.top_k(logits, router.top_k)
        return ids, jax.nn.softmax(top, axis=-1)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), router.top_k)
    if router.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def moe(x: jax.Array, router: Router, experts: Experts, dots: jnp.dtype | None = None,
        expert_parallel: bool = False, backend: str = "xla") -> jax.Array:
    """x [T, H] -> [T, H]: each token through its top-k experts, weighted by the router.
    expert_parallel: the experts' leading axis is split over the "model" axis (MoeConfig).
    backend: the step's attention backend ("pallas": the grouped matmul kernel, see above)."""
    ids, weights = route(x, router, dots)
    mesh = _expert_mesh(experts) if expert_parallel or backend in PALLAS_BACKENDS else None
    if mesh is not None and not expert_parallel and _kernel_on_slices(experts, mesh):
        return _intermediate_split(x, ids, weights, experts, dots, backend, mesh)
    if mesh is None or not expert_parallel:
        return _combine(expert_swiglu(x, ids, experts, dots, backend), weights, x.dtype)

    def shard(x, ids, weights, experts):  # experts: this device's E / n of them
        local = experts.num_experts
        ids = ids - jax.lax.axis_index(MODEL_AXIS) * local
        mine = (ids >= 0) & (ids < local)
        y = expert_swiglu(x, jnp.where(mine, ids, local), experts, dots, backend)  # id `local`: not computed
        return jax.lax.psum(_combine(y, jnp.where(mine, weights, 0.0), x.dtype), MODEL_AXIS)

    spec = jax.tree.map(lambda _: P(MODEL_AXIS), experts)  # every leaf (packed ones, biases too) is [E, ...]
    return jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), spec), out_specs=P(),
                         check_vma=False)(x, ids, weights, experts)


def _kernel_on_slices(experts: Experts, mesh) -> bool:
    """Whether the Pallas kernel runs on each device's intermediate slice: float stacks whose I
    divides over the model axis (packed ones take the XLA blocked path, which XLA partitions; an
    I that does not divide is replicated, nothing to gather)."""
    return not is_packed(experts.w_gate) and experts.w_gate.shape[-1] % dict(mesh.shape)[MODEL_AXIS] == 0


def _intermediate_split(x, ids, weights, experts: Experts, dots, backend: str, mesh) -> jax.Array:
    """Tensor parallelism without expert parallelism, on the Pallas backend (float stacks): each
    device runs the grouped matmuls on its slice of every expert's intermediate axis (gate/up
    columns, down rows: moe_layers.moe_partition_rules' placement) inside a shard_map -- a Pallas kernel has no partitioning rule, so
    XLA would otherwise gather the whole stacks to every device -- and one psum adds the partial
    down projections, as a dense MLP's all-reduce."""
    b_down, experts = experts.b_down, replace(experts, b_down=None)  # added once, after the psum
    column = P(None, MODEL_AXIS) if experts.b_gate is not None else None  # gate/up biases split as their columns
    specs = Experts(P(None, None, MODEL_AXIS), P(None, None, MODEL_AXIS), P(None, MODEL_AXIS, None),  # moe_layers' plan
                    column, column, None, experts.activation)

    def shard(x, ids, weights, experts):
        return jax.lax.psum(_combine(expert_swiglu(x, ids, experts, dots, backend), weights, x.dtype), MODEL_AXIS)

    out = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), specs), out_specs=P(),
                        check_vma=False)(x, ids, weights, experts)
    if b_down is None:
        return out
    return (out + _combine(b_down[ids].astype(jnp.float32), weights, jnp.float32)).astype(x.dtype)


def _combine(y: jax.Array, weights: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """y [T, k, H], weights [T, k] -> [T, H] in `dtype`."""
    return jnp.einsum("tkh,tk->th", y, weights.astype(y.dtype)).astype(dtype)


def _expert_mesh(experts: Experts):
    """The jit's mesh when the experts are split over a "model" axis of more than one device."""
    sharding = getattr(jax.typeof(first_leaf(experts.w_gate)), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or dict(mesh.shape).get(MODEL_AXIS, 1) == 1:
        return None
    return mesh


def expert_swiglu(x: jax.Array, ids: jax.Array, experts: Experts, dots: jnp.dtype | None = None,
                  backend: str = "xla") -> jax.Array:
    """x [T, H], ids [T, k] (an id of E or more: a row nobody computes, output 0) -> [T, k, H].
    The one place the path is chosen (see the module docstring)."""
    num_tokens, k = ids.shape
    grouped = backend in PALLAS_BACKENDS
    if num_tokens * k <= GATHER_MAX_ROWS and not grouped:
        return _gathered_swiglu(x, ids, experts, dots)
    flat = ids.reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=experts.num_experts)  # ids >= E fall outside every group
    swiglu = (lambda *a: _grouped_swiglu(*a, backend)) if grouped else _sorted_swiglu
    y_sorted = swiglu(x[order // k], sizes, experts, dots)  # [T*k, H]
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    return y.reshape(num_tokens, k, -1)


def _swiglu(x: jax.Array, experts: Experts, e: jax.Array, dots) -> jax.Array:
    """x [C, H] through expert e (traced) -> [C, H]; `dots`: bfloat16 operands, float32 sums."""
    c = jnp.float32 if dots is not None else None
    cast = (lambda a: a.astype(dots)) if dots is not None else (lambda a: a)
    weight = lambda w: cast(expert_weight(w, e, x.dtype))  # noqa: E731  (packed: this expert dequantized)
    gate = jnp.dot(cast(x), weight(experts.w_gate), preferred_element_type=c)
    up = jnp.dot(cast(x), weight(experts.w_up), preferred_element_type=c)
    if experts.b_gate is not None:
        gate, up = gate + experts.b_gate[e], up + experts.b_up[e]
    h = experts.act(gate, up).astype(x.dtype)
    out = jnp.dot(cast(h), weight(experts.w_down), preferred_element_type=c)
    return (out if experts.b_down is None else out + experts.b_down[e]).astype(x.dtype)


def _grouped_swiglu(lhs: jax.Array, sizes: jax.Array, experts: Experts, dots, backend: str) -> jax.Array:
    """lhs [M, H] sorted by expert, sizes [E] (rows past their sum: output 0) -> [M, H] with three
    grouped matmuls (expert_weights.grouped_matmul: the Pallas kernel on the Pallas backend)."""
    gate = grouped_matmul(lhs, experts.w_gate, sizes, backend, dots)  # [M, I]
    up = grouped_matmul(lhs, experts.w_up, sizes, backend, dots)
    if experts.b_gate is None and experts.b_down is None:
        return grouped_matmul(experts.act(gate, up), experts.w_down, sizes, backend, dots)
    row_expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(lhs.shape[0]), side="right")  # [M]; E: no group
    live = (row_expert < sizes.shape[0])[:, None]

    def bias(b):  # each sorted row's expert's bias [M, n] (0 past the groups, or with no bias)
        if b is None:
            return 0
        return jnp.where(live, b[jnp.minimum(row_expert, sizes.shape[0] - 1)], 0).astype(gate.dtype)

    h = experts.act(gate + bias(experts.b_gate), up + bias(experts.b_up))
    return grouped_matmul(h, experts.w_down, sizes, backend, dots) + bias(experts.b_down)


def _gathered_swiglu(x: jax.Array, ids: jax.Array, experts: Experts, dots) -> jax.Array:
    """Each of the T*k rows through its own expert, one row at a time (a loop of T*k matrix-vector
    products, each reading only its expert's weights): [T, k, H]."""
    num_tokens, k = ids.shape
    num_experts = experts.num_experts

    def one(args):
        row, e = args  # [1, H], scalar
        return jax.lax.cond(e < num_experts, lambda: _swiglu(row, experts, e, dots), lambda: jnp.zeros_like(row))

    rows = jnp.repeat(x, k, axis=0)[:, None, :]  # [T*k, 1, H]
    return jax.lax.map(one, (rows, ids.reshape(-1))).reshape(num_tokens, k, -1)


def capacity(num_rows: int, num_experts: int, num_tokens: int) -> int:
    """Slots per expert in one round: twice the balanced share, a power of two, at most T."""
    fair = max(1, -(-2 * num_rows // num_experts))
    return min(num_tokens, 1 << (fair - 1).bit_length())


def _sorted_swiglu(lhs: jax.Array, sizes: jax.Array, experts: Experts, dots) -> jax.Array:
    """lhs [M, H] sorted by expert, sizes [E] rows per expert (sum <= M: the rest is not
    computed, output 0) -> [M, H]. Rounds of C slots per expert until the largest group is done;
    within a round a loop over the experts, each one's C rows times its weights, an expert with
    no rows left skipped (its weights never read)."""
    m, num_experts = lhs.shape[0], experts.num_experts
    c = capacity(m, num_experts, m)
    starts = jnp.cumsum(sizes) - sizes  # [E]

    def one_round(i, out):
        def expert(args):
            e, start, size = args
            pos = i * c + jnp.arange(c)  # [C] rows of this round within the expert's group
            valid = pos < size
            rows = jnp.where(valid, start + pos, m)  # m: out of range, dropped on write

            def run():
                xs = jnp.where(valid[:, None], lhs[jnp.minimum(rows, m - 1)], 0)  # [C, H]
                return _swiglu(xs, experts, e, dots)

            return rows, jax.lax.cond(size > i * c, run, lambda: jnp.zeros((c, lhs.shape[1]), lhs.dtype))

        rows, ys = jax.lax.map(expert, (jnp.arange(num_experts), starts, sizes))  # [E, C], [E, C, H]
        return out.at[rows.reshape(-1)].set(ys.reshape(-1, ys.shape[-1]), mode="drop")

    rounds = (jnp.max(sizes) + c - 1) // c
    return jax.lax.fori_loop(0, rounds, one_round, jnp.zeros_like(lhs))
