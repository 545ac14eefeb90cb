"""The Mixture-of-Experts block: route each token to its top-k experts, run only those rows.

    x [T, H] --route--> ids [T, k] i32, weights [T, k] f32
      Pallas backend   grouped: the T*k rows sorted by expert, gate/up/down as three grouped
                       matmuls (expert_weights.grouped_matmul: pallas_kernels/grouped_matmul.py)
      T*k small        gather (_gather_max_rows: 4E; 2E with layer views, fp8 8, mxfp4 E): each
                       row times its own expert, in chunks of independent products
      otherwise        batched: the rows sorted by expert, every expert's first C rows in three
                       batched dots over the stacks, a group's rows past C through a loop over
                       blocks of one expert (nothing dropped); or that loop for every row: packed
                       stacks, a LayerStack without layer views, or too few experts with rows
    y [T, k, H] -> sum_k weights * y -> [T, H]

`expert_swiglu` is the one place the path is chosen. Why (XLA:CPU): the gather path reads only the
touched experts; batched dots over all the stacks beat per-expert loops once most experts have
rows; `jax.lax.ragged_dot` lowers as a masked dense product per expert (not used). Every stack is
output-major, [E, N, K] (each expert [out, in], as nn.Linear and the hub store it;
expert_weights.py), so `row @ w[e].T` fuses into one loop reading the expert once.

In the engine the layer scan hands each layer the whole [L, E, N, K] stacks and its index
(expert_weights.LayerStack): a per-layer slice would be copied whole each step before any path
(or the Pallas kernel's custom call) reads it. On one CPU device each layer's stacks also come as
zero-copy arrays of their own in VIEW_PARTS parts (LayerStack.layers), which the batched dots
`lax.switch` to, three dots a part, so that XLA:CPU runs the parts on all its cores.

Packed experts (block-wise fp8 QuantizedWeight, Mxfp4Weight) are dequantized inside the program,
only the touched ones. The experts run in their weights' dtype; the CPU default keeps a bfloat16
checkpoint's experts as their bits (expert_weights.bf16_bits, at load): every path widens what it
reads to float32 exactly inside its product, and in a step of bfloat16 dots (engine/config.py,
bf16_dots_from) the batched dots read the layers' own arrays as bfloat16. Padding rows of a step
(`valid`) are routed nowhere: alike, they would all pick the same experts and overflow them.

Expert parallelism (`--enable-expert-parallel`): the expert axis is split over the mesh's
"model" axis; every device sees every token (x replicated), keeps the rows routed to its own
experts (others get weight 0 and are sorted past the last group), and one `psum` adds the
devices' partial sums (shard_map; the mesh is the jit's own, read from the weights' avals).
Without the flag, on the Pallas backend, the same shard_map runs each device's slice of every
expert's intermediate axis (`_intermediate_split`): XLA cannot partition a Pallas kernel itself.

The figures behind each choice and threshold (scripts/bench_moe.py on the 2-core Xeon):
docs/benchmarks/log.md, "the MoE layer's paths, the figures behind jaxserve/models/moe.py"; the
design in docs/design/moe.md; the current results in BENCHMARKS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.models.attention import PALLAS_BACKENDS
from jaxserve.models.dense_attention import DENSE
from jaxserve.models.expert_weights import (BF16_BITS, ExpertWeight, LayerStack, expert_weight, first_leaf,
                                            grouped_matmul, is_packed, resolve, widen)
from jaxserve.models.expert_weights import num_experts as stack_size
from jaxserve.quantization.matmul import matmul, model_mesh
from jaxserve.quantization.qweight import QuantizedWeight

BATCHED_TOUCHED = 0.6  # with LayerStack.layers: the batched dots when this share of the experts has rows
BATCHED_TOUCHED_BF16 = 0.3  # the same for stacks of bfloat16 bits, whose batched dots are bfloat16 (_busy_batched)
GATHER_CHUNK = (8, 16)  # rows an iteration of the gather path's loop: to 64 rows, past 64 (_gathered_swiglu)
SLOT_SIGMAS = 2.0  # the batched pass's slots per expert: the mean share + this many standard deviations
MODEL_AXIS = "model"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Experts:
    """The stacked weights of E experts (SwiGLU), as one layer sees them (float, or packed:
    expert_weights.py); a family's variations are optional biases and its own gated activation
    (gpt-oss: both)."""
    w_gate: ExpertWeight  # [E, I, H]: each expert [out, in], as nn.Linear (and the hub) store it
    w_up: ExpertWeight  # [E, I, H]
    w_down: ExpertWeight  # [E, H, I]
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
    # a family's own selection, in place of `kind`'s: (float32 logits [T, E], correction_bias) -> (ids [T, k],
    # weights [T, k] f32); hashable (a frozen dataclass: models/deepseek_router.py). Its logits are float32
    # products of float32 inputs (DeepSeek keeps its gate in float32), the bias is for it alone.
    select: Callable | None = field(default=None, metadata=dict(static=True))
    correction_bias: jax.Array | None = None  # [E]: DeepSeek-V3's e_score_correction_bias


def route(x: jax.Array, router: Router, dots: jnp.dtype | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, H] -> expert ids [T, k] i32 and routing weights [T, k] f32 (as transformers: the
    logits in x's dtype, the softmax in float32)."""
    if router.select is not None:
        logits = jnp.dot(x.astype(jnp.float32), router.weight.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)  # not TF32 on GPUs: ties in the top-k
        return router.select(logits, router.correction_bias)
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
        expert_parallel: bool = False, backend: str = "xla", valid: jax.Array | None = None) -> jax.Array:
    """x [T, H] -> [T, H]: each token through its top-k experts, weighted by the router.
    expert_parallel: the experts' leading axis is split over the "model" axis (MoeConfig).
    backend: the step's attention backend ("pallas": the grouped matmul kernel, see above).
    valid [T] bool: the step's real tokens (None: all); padding rows are routed nowhere (output 0)
    -- alike, they would all pick the same k experts and overflow their slots."""
    ids, weights = route(x, router, dots)  # the experts run in their weights' dtype (module docstring)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, experts.num_experts)  # id E: a row nobody computes
        weights = jnp.where(valid[:, None], weights, 0.0)
    mesh = None
    if expert_parallel or backend in PALLAS_BACKENDS:  # a LayerStack goes whole into the shard_maps
        mesh = model_mesh(first_leaf(experts.w_gate), MODEL_AXIS)
    if mesh is not None and not expert_parallel and _kernel_on_slices(experts, mesh):
        return _intermediate_split(x, ids, weights, experts, backend, mesh)
    if mesh is None or not expert_parallel:
        return _combine(expert_swiglu(x, ids, experts, backend, dots), weights, x.dtype)

    def shard(x, ids, weights, experts):  # experts: this device's E / n of them
        local = experts.num_experts
        ids = ids - jax.lax.axis_index(MODEL_AXIS) * local
        mine = (ids >= 0) & (ids < local)
        y = expert_swiglu(x, jnp.where(mine, ids, local), experts, backend)  # id `local`: not computed
        return jax.lax.psum(_combine(y, jnp.where(mine, weights, 0.0), x.dtype), MODEL_AXIS)

    # every leaf (packed ones, biases too) is [E, ...], a LayerStack's [L, E, ...]
    spec = jax.tree.map(lambda _: P(MODEL_AXIS), replace(experts, w_gate=None, w_up=None, w_down=None))
    spec = replace(spec, **{n: _stack_spec(getattr(experts, n), P(MODEL_AXIS)) for n in ("w_gate", "w_up", "w_down")})
    return jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), spec), out_specs=P(),
                         check_vma=False)(x, ids, weights, experts)


def _stack_spec(w: ExpertWeight, spec: P) -> ExpertWeight:
    """A shard_map in_spec for an expert stack split as `spec` on its [E, ...] axes: a LayerStack's
    whole stacks keep their layer axis unsplit (each device reads its layer in place)."""
    if isinstance(w, LayerStack):
        return LayerStack(jax.tree.map(lambda _: P(None, *spec), w.stack), P(), None)
    return jax.tree.map(lambda _: spec, w)


def _stored(w: ExpertWeight) -> ExpertWeight:
    return w.stack if isinstance(w, LayerStack) else w


def _kernel_on_slices(experts: Experts, mesh) -> bool:
    """Whether the Pallas kernel runs on each device's intermediate slice: float stacks whose I
    divides over the model axis (packed ones take the XLA blocked path, which XLA partitions; an
    I that does not divide is replicated, nothing to gather)."""
    return not is_packed(experts.w_gate) and first_leaf(experts.w_gate).shape[-2] % dict(mesh.shape)[MODEL_AXIS] == 0


def _intermediate_split(x, ids, weights, experts: Experts, backend: str, mesh) -> jax.Array:
    """Tensor parallelism without expert parallelism, on the Pallas backend (float stacks): each
    device runs the grouped matmuls on its slice of every expert's intermediate axis (gate/up
    outputs, down inputs: moe_layers.moe_partition_rules' placement) inside a shard_map -- a Pallas kernel has no partitioning rule, so
    XLA would otherwise gather the whole stacks to every device -- and one psum adds the partial
    down projections, as a dense MLP's all-reduce."""
    b_down, experts = experts.b_down, replace(experts, b_down=None)  # added once, after the psum
    column = P(None, MODEL_AXIS) if experts.b_gate is not None else None  # gate/up biases split as their outputs
    rows, cols = P(None, MODEL_AXIS, None), P(None, None, MODEL_AXIS)  # moe_layers' plan
    specs = Experts(_stack_spec(experts.w_gate, rows), _stack_spec(experts.w_up, rows),
                    _stack_spec(experts.w_down, cols), column, column, None, experts.activation)

    def shard(x, ids, weights, experts):
        return jax.lax.psum(_combine(expert_swiglu(x, ids, experts, backend), weights, x.dtype), MODEL_AXIS)

    out = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), specs), out_specs=P(),
                        check_vma=False)(x, ids, weights, experts)
    if b_down is None:
        return out
    return (out + _combine(b_down[ids].astype(jnp.float32), weights, jnp.float32)).astype(x.dtype)


def _combine(y: jax.Array, weights: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """y [T, k, H], weights [T, k] -> [T, H] in `dtype`."""
    return jnp.einsum("tkh,tk->th", y, weights.astype(y.dtype)).astype(dtype)


def expert_swiglu(x: jax.Array, ids: jax.Array, experts: Experts, backend: str = "xla",
                  dots: jnp.dtype | None = None) -> jax.Array:
    """x [T, H], ids [T, k] (an id of E or more: a row nobody computes, output 0) -> [T, k, H].
    The one place the path is chosen (see the module docstring). dots: the step's dot dtype
    (bfloat16: stacks of bfloat16 bits may take the batched dots, in bfloat16)."""
    num_tokens, k = ids.shape
    # the dense (training) backend: the grouped path over XLA's blocked matmul, the one path with no
    # data-dependent loop, so jax.grad runs through it (models/dense_attention.py)
    grouped = backend in PALLAS_BACKENDS or backend == DENSE
    flat = ids.reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True)  # every path takes the rows sorted by expert
    lhs = x[order // k]  # [T*k, H]
    if num_tokens * k <= _gather_max_rows(experts) and not grouped:
        y_sorted = _gathered_swiglu(lhs, flat[order], experts)
    else:
        sizes = jnp.bincount(flat, length=experts.num_experts)  # ids >= E fall outside every group
        if grouped:
            swiglu = lambda *a: _grouped_swiglu(*a, backend)  # noqa: E731
        elif is_packed(experts.w_gate):  # unpacking every stack each step costs more than the loop
            swiglu = _looped_swiglu
        elif _has_views(experts) and (dots == jnp.bfloat16 or not _bf16_bits(experts)):
            swiglu = _busy_batched  # the batched dots on the layer's own arrays, when most experts have rows
        elif isinstance(experts.w_gate, LayerStack):  # the batched dots would copy the layer's stacks out
            swiglu = _looped_swiglu
        else:
            swiglu = _batched_swiglu
        y_sorted = swiglu(lhs, sizes, experts)  # [T*k, H]
    return unsort(y_sorted, order).reshape(num_tokens, k, -1)


def unsort(y_sorted: jax.Array, order: jax.Array) -> jax.Array:
    """Rows sorted by `order` (y_sorted[i] belongs to row order[i]) back in their own order: a
    gather through order's inverse, cheaper than scattering the rows."""
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return y_sorted[rank]


def _row_experts(sizes: jax.Array, num_rows: int) -> jax.Array:
    """Each of num_rows rows sorted by expert (groups of sizes [E]) -> its expert [num_rows]; E for
    the rows past the groups."""
    return jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(num_rows), side="right")


def _gather_max_rows(experts: Experts) -> int:
    """The most rows (T*k) the gather path takes: it reads an expert per row (from the cache for an
    expert's later rows: they come sorted), the batched path every expert. 4E for float stacks
    (2E with layer views, whose batched pass is faster); 8 for fp8 stacks, whose per-row
    dequantization costs more than the per-expert loop's past one decode token; E for mxfp4.
    Break-even figures: docs/benchmarks/log.md (module docstring)."""
    stored = _stored(experts.w_gate)
    if isinstance(stored, QuantizedWeight):
        return 8
    if is_packed(stored):
        return experts.num_experts
    return experts.num_experts * (2 if _has_views(experts) else 4)


def _has_views(experts: Experts) -> bool:
    """Whether every stack comes with its layers as arrays of their own (LayerStack.layers)."""
    ws = (experts.w_gate, experts.w_up, experts.w_down)
    return all(isinstance(w, LayerStack) and w.layers is not None for w in ws)


def _bf16_bits(experts: Experts) -> bool:
    """Whether the stacks hold bfloat16 bits (expert_weights.widen): their layers' own arrays are then
    bfloat16, whose batched dots round the rows -- taken only in steps of bfloat16 dots (64+ tokens)."""
    return first_leaf(experts.w_gate).dtype == BF16_BITS


def _swiglu(x: jax.Array, experts: Experts, e: jax.Array) -> jax.Array:
    """x [C, H] through expert e (traced) -> [C, H]. Each weight is `x @ w[e].T` (expert_weight: a
    float expert's slice, transpose and dot fuse into one XLA:CPU loop that reads it once; a
    dot_general contracting w's last axis directly is not fused, and slower)."""
    weight = lambda w: expert_weight(w, e, x.dtype)  # noqa: E731  [K, N] (packed: this expert dequantized)
    dot = lambda a, w: a.astype(w.dtype) @ w  # noqa: E731  (each product in the weights' dtype, as the kernel's)
    gate, up = dot(x, weight(experts.w_gate)), dot(x, weight(experts.w_up))
    if experts.b_gate is not None:
        gate, up = gate + experts.b_gate[e], up + experts.b_up[e]
    out = dot(experts.act(gate, up).astype(x.dtype), weight(experts.w_down))
    return (out if experts.b_down is None else out + experts.b_down[e]).astype(x.dtype)


def _stacked_swiglu(xs: jax.Array, experts: Experts, sums: jnp.dtype | None = None) -> jax.Array:
    """xs [E, C, H] (expert e's C slots) through every expert at once -> [E, H, C]: three batched
    dots in the weights' own [E, N, K] order, the activations kept [E, I, C] between them. Stacks
    with their layers' own arrays (LayerStack.layers) branch to the layer's, read in place, three
    dots for each of its parts (independent: XLA:CPU runs them side by side). sums: the dots'
    result dtype (None: the weights'; float32 for the bfloat16 arrays over bfloat16 bits)."""
    if _has_views(experts):
        sums = jnp.float32 if _bf16_bits(experts) else None
        def layer(xs, i: int) -> jax.Array:
            outs = []
            for p, (wg, wu, wd) in enumerate(zip(experts.w_gate.layers[i], experts.w_up.layers[i],
                                                 experts.w_down.layers[i])):
                cut = slice(p * wg.shape[0], (p + 1) * wg.shape[0])  # the parts are equal (layer_views)
                bias = lambda b: None if b is None else b[cut]  # noqa: E731
                part = replace(experts, w_gate=wg, w_up=wu, w_down=wd, b_gate=bias(experts.b_gate),
                               b_up=bias(experts.b_up), b_down=bias(experts.b_down))
                outs.append(_stacked_swiglu(xs[cut], part, sums))
            return jnp.concatenate(outs)

        branches = [lambda xs, i=i: layer(xs, i) for i in range(len(experts.w_gate.layers))]
        return jax.lax.switch(experts.w_gate.layer, branches, xs)
    # float stacks (packed ones loop: expert_swiglu), the layer's own (a LayerStack's copied out)
    wg, wu, wd = resolve(experts.w_gate), resolve(experts.w_up), resolve(experts.w_down)
    wg, wu, wd = widen(wg), widen(wu), widen(wd)  # bfloat16 bits without their layers' arrays: a copy
    dot = lambda w, a, dims: jax.lax.dot_general(w, a.astype(w.dtype), dims,  # noqa: E731
                                                 preferred_element_type=sums)
    batched = (((2,), (2,)), ((0,), (0,)))  # w [E, N, K] . x [E, C, K] -> [E, N, C]
    gate, up = dot(wg, xs, batched), dot(wu, xs, batched)  # [E, I, C]
    if experts.b_gate is not None:
        gate, up = gate + experts.b_gate[:, :, None], up + experts.b_up[:, :, None]
    h = experts.act(gate, up)  # [E, I, C]
    out = dot(wd, h, (((2,), (1,)), ((0,), (0,))))  # [E, H, C]
    if experts.b_down is not None:
        out = out + experts.b_down[:, :, None]
    # The barrier keeps XLA from choosing the dots' output layout for what reads it: for a transpose
    # it transposed every weight stack instead (several times slower).
    return jax.lax.optimization_barrier(out).astype(xs.dtype)  # [E, H, C]


def _grouped_swiglu(lhs: jax.Array, sizes: jax.Array, experts: Experts, backend: str) -> jax.Array:
    """lhs [M, H] sorted by expert, sizes [E] (rows past their sum: output 0) -> [M, H] with three
    grouped matmuls (expert_weights.grouped_matmul: the Pallas kernel on the Pallas backend)."""
    gate = grouped_matmul(lhs, experts.w_gate, sizes, backend)  # [M, I]
    up = grouped_matmul(lhs, experts.w_up, sizes, backend)
    if experts.b_gate is None and experts.b_down is None:
        return grouped_matmul(experts.act(gate, up), experts.w_down, sizes, backend)
    row_expert = _row_experts(sizes, lhs.shape[0])  # [M]; E: no group
    live = (row_expert < sizes.shape[0])[:, None]

    def bias(b):  # each sorted row's expert's bias [M, n] (0 past the groups, or with no bias)
        if b is None:
            return 0
        return jnp.where(live, b[jnp.minimum(row_expert, sizes.shape[0] - 1)], 0).astype(gate.dtype)

    h = experts.act(gate + bias(experts.b_gate), up + bias(experts.b_up))
    return grouped_matmul(h, experts.w_down, sizes, backend) + bias(experts.b_down)


def _gathered_swiglu(lhs: jax.Array, row_experts: jax.Array, experts: Experts) -> jax.Array:
    """Each row of lhs [M, H] through its expert row_experts[m] (an id of E or more: output 0), a
    matrix-vector product reading only its expert's weights: [M, H]. The rows come sorted by
    expert (expert_swiglu), so an expert's later rows find it in the cache, and the rows nobody
    computes come last. A loop over chunks of GATHER_CHUNK rows (one chunk: no loop): a chunk's
    products are independent and XLA:CPU runs them side by side (faster than one row an
    iteration behind its own `cond`); a chunk whose first row is past the groups is skipped."""
    num_experts, (m, h) = experts.num_experts, lhs.shape
    size = GATHER_CHUNK[m > 64]
    pad = -m % size
    xs = jnp.pad(lhs, ((0, pad), (0, 0))).reshape(-1, size, h)
    ids = jnp.pad(row_experts, (0, pad), constant_values=num_experts).reshape(-1, size)
    if xs.shape[0] == 1:
        return _chunk_rows(xs[0], ids[0], experts)[:m]

    def chunk(args):
        x, e = args
        return jax.lax.cond(e[0] < num_experts, lambda: _chunk_rows(x, e, experts), lambda: jnp.zeros_like(x))

    return jax.lax.map(chunk, (xs, ids)).reshape(-1, h)[:m]


def _chunk_rows(x: jax.Array, e: jax.Array, experts: Experts) -> jax.Array:
    """Rows x [C, H] each through its expert e [C] -> [C, H], unrolled: independent products. A row
    past the groups (e >= E) reuses the first row's expert (already in the cache) and is zeroed."""
    live = e < experts.num_experts
    return jnp.concatenate([jnp.where(live[j], _swiglu(x[j:j + 1], experts, jnp.where(live[j], e[j], e[0])), 0)
                            for j in range(x.shape[0])])


def _busy_batched(lhs: jax.Array, sizes: jax.Array, experts: Experts) -> jax.Array:
    """`_batched_swiglu` when at least BATCHED_TOUCHED of the experts have rows, else `_looped_swiglu`
    (chosen in the program, from sizes): the batched dots read every expert, the loop only the
    touched ones, and a router may leave most experts idle even at hundreds of tokens. The shares
    are where the two break even in the layer scan (float stacks; stacks of bfloat16 bits, whose
    batched dots run in bfloat16, 2x faster): figures in docs/benchmarks/log.md."""
    share = BATCHED_TOUCHED_BF16 if _bf16_bits(experts) else BATCHED_TOUCHED
    busy = jnp.count_nonzero(sizes) >= math.ceil(share * experts.num_experts)
    return jax.lax.cond(busy, _batched_swiglu, _looped_swiglu, lhs, sizes, experts)


def capacity(num_rows: int, num_experts: int) -> int:
    """Slots per expert of the batched pass: the balanced share plus SLOT_SIGMAS of its standard
    deviations, a multiple of 4, at most num_rows."""
    mean = num_rows / num_experts
    slots = 4 * math.ceil((mean + SLOT_SIGMAS * math.sqrt(mean)) / 4)
    return max(1, min(num_rows, slots))


def _batched_swiglu(lhs: jax.Array, sizes: jax.Array, experts: Experts) -> jax.Array:
    """lhs [M, H] sorted by expert, sizes [E] rows per expert (sum <= M: the rest is not computed,
    output 0) -> [M, H]. Every expert's first C rows in one batched pass over all the weights
    (_stacked_swiglu), each sorted row then gathering its slot's result; the rows of a group
    larger than C (a skewed batch) then go through `_looped_swiglu`, which reads only the experts
    that have them. Nothing is dropped."""
    m, num_experts = lhs.shape[0], experts.num_experts
    c = capacity(m, num_experts)
    starts = jnp.cumsum(sizes) - sizes  # [E]
    pos = jnp.arange(c)
    valid = pos[None, :] < sizes[:, None]  # [E, C]
    xs = jnp.where(valid[..., None], lhs[jnp.minimum(starts[:, None] + pos, m - 1)], 0)  # [E, C, H]
    ys = _stacked_swiglu(xs, experts)  # [E, H, C]
    row_expert = _row_experts(sizes, m)  # [M]; E: past the groups
    row_pos = jnp.arange(m) - starts[jnp.minimum(row_expert, num_experts - 1)]
    slotted = (row_expert < num_experts) & (row_pos < c)
    out = jnp.where(slotted[:, None], ys[jnp.where(slotted, row_expert, 0), :, jnp.where(slotted, row_pos, 0)], 0)
    left = jnp.maximum(sizes - c, 0)
    return jax.lax.cond(jnp.any(left > 0), lambda: _looped_swiglu(lhs, left, experts, starts + c, out),
                        lambda: out)


def _looped_swiglu(lhs: jax.Array, sizes: jax.Array, experts: Experts, starts: jax.Array | None = None,
                   out: jax.Array | None = None) -> jax.Array:
    """Expert e's rows starts[e] .. starts[e] + sizes[e] of lhs [M, H] (starts: the groups' own
    starts when None) through it, written into out [M, H] (zeros when None): a loop over blocks of
    C consecutive rows of one expert, only the blocks that have rows (an expert with none is never
    read), each block read and written in place (a slice of lhs and of out)."""
    m, num_experts = lhs.shape[0], experts.num_experts
    c = capacity(m, num_experts)
    starts = jnp.cumsum(sizes) - sizes if starts is None else starts
    out = jnp.zeros_like(lhs) if out is None else out
    blocks = (sizes + c - 1) // c  # [E]
    block_ends = jnp.cumsum(blocks)

    def block(b, out):
        e = jnp.searchsorted(block_ends, b, side="right")  # the block's expert
        first = starts[e] + (b - (block_ends[e] - blocks[e])) * c  # its first row
        base = jnp.clip(first, 0, m - c)  # the slice stays in range; rows outside the block are kept
        rows = base + jnp.arange(c)
        mine = ((rows >= first) & (rows < jnp.minimum(first + c, starts[e] + sizes[e])))[:, None]
        xs = jax.lax.dynamic_slice_in_dim(lhs, base, c)
        ys = _swiglu(jnp.where(mine, xs, 0), experts, e)
        kept = jax.lax.dynamic_slice_in_dim(out, base, c)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, ys, kept), base, 0)

    return jax.lax.fori_loop(0, block_ends[-1], block, out)
