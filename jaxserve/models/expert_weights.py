"""One expert projection stack [E, N, K] in any of its stored forms, and the grouped matmuls over it.

Every form is output-major, each expert [out, in] as nn.Linear and the hub store it: contracting
the last axis (x @ w.T) lets XLA:CPU read an expert inside the dot's own loop (models/moe.py).

    float            jax.Array [E, N, K]
    bf16 bits        jax.Array [E, N, K] of dtype uint16: bfloat16 values' bits (the CPU default's
                     experts of a bfloat16 checkpoint, half float32's bytes: `bf16_bits`); every
                     reader widens them to float32 exactly, inside the product that reads them
                     (`widen`: a bfloat16-typed stack is converted whole by XLA:CPU before any use)
    fp8_block        QuantizedWeight: values e4m3 [E, N, K], scales f32 [E, cdiv(N, bn), cdiv(K, bk)]
                     (block-wise FP8 checkpoints: Qwen3-*-FP8, transformers' FineGrainedFP8)
    mxfp4            Mxfp4Weight: blocks u8 [E, N, K / 32, 16], scales u8 [E, N, K / 32] (gpt-oss)

The packed forms stay packed in device memory; every reader here dequantizes only the experts
it is asked for (`expert_weight`: one, `take_experts`: a list), inside the program, so a step
reads the packed bytes of the experts it touches and nothing else.

    grouped_matmul(lhs, w, sizes, backend)   rows sorted by expert [M, K] . w [E, N, K] -> [M, N]
      float w, Pallas backend, K and N multiples of 16
                     pallas_kernels.grouped_matmul (Triton on GPU; interpret mode in tests); a
                     LayerStack's whole [L, E, N, K] stack and its layer go to the kernel as they
                     are (it reads the layer in place: a slice would likely be copied for the call)
      otherwise      the kernel's alignment in XLA: the rows cut into B = cdiv(M, bm) + min(E, M)
                     blocks of one expert each, the blocks' experts gathered (packed: dequantized), one
                     batched dot, rows scattered back
      packed w with B >= E (large batches): the whole stack is dequantized once, then as a float w
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.attention import PALLAS_BACKENDS, PALLAS_INTERPRET
from jaxserve.quantization.mxfp4 import Mxfp4Weight, dequantize_experts
from jaxserve.quantization.qweight import QuantizedWeight, dequantize
from pallas_kernels.grouped_matmul import align_block_size, num_row_blocks
from pallas_kernels.grouped_matmul import grouped_matmul as pallas_grouped_matmul
from pallas_kernels.grouped_matmul import supported as pallas_supported

XLA_BLOCK_M = 8  # rows per block of the XLA grouped path (a block's expert is dequantized once)
EXPERT_STACKS = ("we_gate", "we_up", "we_down")  # a MoE layer's expert stacks, [L, E, out, in] in the params
# layer_views: each layer's experts as this many arrays of E / VIEW_PARTS experts; the batched dots
# run a part each, side by side on XLA:CPU (moe._stacked_swiglu)
VIEW_PARTS = 8
BF16_BITS = jnp.uint16  # a float stack of this dtype holds bfloat16 bits (`widen`)
LAYER_VIEWS = "expert_layer_views"  # params["layers"][LAYER_VIEWS]: {stack name: layer_views(stack)}, when made


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerStack:
    """Layer `layer` of every layer's stack ([L, E, N, K] in any form above), read lazily: a reader
    indexes the layer and the expert in one slice inside its own loop. The layer scan
    (llama.run_layers) hands the expert stacks over this way: sliced by the scan, each layer's
    stacks were copied out whole every step before the per-expert loop read a few experts (a
    1-token step of a 16-layer MoE ran 20 ms a layer, not 0.5). Paths that take whole stacks
    (batched dots, shard_maps, the Pallas kernel) `resolve` it to the layer's [E, N, K].
    `layers`: the same stack as arrays of their own, each aliasing its part of `stack` (XLA:CPU,
    one device: `layer_views`: layers[l] holds layer l's experts in VIEW_PARTS arrays [E / parts, N,
    K]); the batched dots branch to the layer's own arrays (moe._stacked_swiglu), which they read
    in place, where a slice of the stack is copied first."""
    stack: "ExpertWeight"
    layer: jax.Array  # i32 scalar
    layers: tuple[tuple[jax.Array, ...], ...] | None = None


ExpertWeight = jax.Array | QuantizedWeight | Mxfp4Weight | LayerStack


def widen(a: jax.Array) -> jax.Array:
    """A float stack's values: bfloat16 bits (uint16) widened to float32 exactly (a shift, fused
    into the reader's loop on XLA:CPU); other dtypes as they are."""
    if a.dtype != BF16_BITS:
        return a
    return jax.lax.bitcast_convert_type(a.astype(jnp.uint32) << 16, jnp.float32)


def host_bf16_bits(a: np.ndarray) -> np.ndarray | None:
    """A host float array's values as their bfloat16 bits (BF16_BITS), or None where one is not a
    bfloat16 value (converting would round it)."""
    if a.dtype == jnp.bfloat16:
        return a.view(BF16_BITS)
    words = np.asarray(a, np.float32).view(np.uint32)
    return None if np.any(words & 0xFFFF) else (words >> 16).astype(BF16_BITS)


def bf16_bits(stack: jax.Array) -> jax.Array | None:
    """A float32 stack on one device whose values are all bfloat16 values (a bfloat16 checkpoint
    loaded in float32) as their bfloat16 bits (uint16, placed as the stack is), or None where that
    would round a value. Converted one leading index at a time (no whole-stack temporaries)."""
    if not isinstance(stack, jax.Array) or stack.dtype != jnp.float32 or len(stack.devices()) != 1:
        return None
    host = np.asarray(stack)
    bits = np.empty(host.shape, BF16_BITS)
    for i in range(host.shape[0]):
        b = host_bf16_bits(host[i])
        if b is None:
            return None
        bits[i] = b
    return jax.device_put(bits, next(iter(stack.devices()))) if stack.committed else jax.device_put(bits)


def with_bf16_bits(layers: dict) -> dict:
    """The params' `layers` with every expert stack as its bfloat16 bits (`bf16_bits`) where all of
    them hold bfloat16 values; otherwise `layers` as they are."""
    bits = {k: bf16_bits(layers[k]) for k in EXPERT_STACKS if k in layers}
    if not bits or any(v is None for v in bits.values()):
        return layers
    return {**layers, **bits}


def resolve(w: ExpertWeight) -> ExpertWeight:
    """The layer's own [E, N, K] stack of a LayerStack (a copy of it, on XLA); other forms as they are."""
    return jax.tree.map(lambda a: a[w.layer], w.stack) if isinstance(w, LayerStack) else w


def layer_views(stack: jax.Array) -> tuple[tuple[jax.Array, ...], ...] | None:
    """Each layer of a float [L, E, N, K] stack on one CPU device as VIEW_PARTS arrays of its own
    (consecutive experts; one array where E does not divide) that share the stack's memory (a
    zero-copy device_put of a view: no bytes are added; bfloat16 arrays over a stack of bfloat16
    bits), or None where they would be copies (another platform, a sharded or packed stack)."""
    if not isinstance(stack, jax.Array) or len(stack.devices()) != 1:
        return None
    device = next(iter(stack.devices()))
    if device.platform != "cpu":
        return None
    host = np.asarray(stack)  # the stack's own memory on the CPU
    if host.dtype == BF16_BITS:  # typed bfloat16: the batched dots read them natively (moe._stacked_swiglu)
        host = host.view(jnp.bfloat16)
    # placed as the stack is: a committed input commits a program's outputs (the KV pool), and the
    # warmed-up programs would then recompile for them
    place = (lambda a: jax.device_put(a, device)) if stack.committed else jax.device_put
    parts = VIEW_PARTS if stack.shape[1] % VIEW_PARTS == 0 else 1
    size = stack.shape[1] // parts
    views = tuple(tuple(place(host[i, p * size:(p + 1) * size]) for p in range(parts))
                  for i in range(stack.shape[0]))
    base, step = stack.unsafe_buffer_pointer(), host[0, :size].nbytes
    if all(v.unsafe_buffer_pointer() == base + (i * parts + p) * step
           for i, layer in enumerate(views) for p, v in enumerate(layer)):
        return views
    return None  # copied: drop them rather than hold the experts twice


def with_layer_views(layers: dict) -> dict:
    """The params' `layers` plus LAYER_VIEWS (every expert stack's `layer_views`) where all of them
    have views; otherwise `layers` as they are."""
    views = {k: layer_views(layers[k]) for k in EXPERT_STACKS if k in layers}
    if not views or any(v is None for v in views.values()):
        return layers
    return {**layers, LAYER_VIEWS: views}


def check_expert_weight(w: ExpertWeight) -> None:
    """ValueError for a quantized form the expert computation does not take."""
    if isinstance(w, QuantizedWeight) and w.scheme != "fp8_block":
        raise ValueError(f"MoE experts: quantized scheme {w.scheme!r} is not supported; expert weights may be "
                         "float, block-wise fp8 (fp8_block) or mxfp4")


def first_leaf(w: ExpertWeight) -> jax.Array:
    """The array whose leading axis is the expert axis, after the layer axis of a LayerStack (its
    sharding is the stack's)."""
    return jax.tree.leaves(w.stack if isinstance(w, LayerStack) else w)[0]


def num_experts(w: ExpertWeight) -> int:
    return first_leaf(w).shape[1 if isinstance(w, LayerStack) else 0]


def is_packed(w: ExpertWeight) -> bool:
    return isinstance(w.stack if isinstance(w, LayerStack) else w, (QuantizedWeight, Mxfp4Weight))


def expert_weight(w: ExpertWeight, e: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Expert e (a traced scalar) of the stack as `x @ weight` takes it, [K, N], in `dtype` (a float
    stack: its own dtype); only that expert's bytes are read. A float expert is `w[e].T`: XLA:CPU
    fuses the slice and transpose into the product; a packed one is dequantized (a temporary:
    about 60 us for a 192 x 512 fp8 expert on XLA:CPU, the price of fp8 experts at decode there)."""
    if isinstance(w, LayerStack):  # the layer and the expert in one slice (no copy of the layer)
        if not is_packed(w):
            return widen(w.stack[w.layer, e]).T
        w, e = jax.tree.map(lambda a: a[w.layer, e][None], w.stack), jnp.zeros((), jnp.int32)  # [1, ...]
    if isinstance(w, Mxfp4Weight):
        return dequantize_experts(w, jnp.reshape(e, (1,)), dtype)[0].T
    if isinstance(w, QuantizedWeight):
        check_expert_weight(w)
        one = jax.tree.map(lambda a: a[e], w)  # values [N, K], scales [Gn, Gk]
        return dequantize(one, dtype).T
    return widen(w[e]).T


def take_experts(w: ExpertWeight, expert_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Experts `expert_ids` (i32[B], clipped into range) -> [B, N, K] in `dtype`."""
    w = resolve(w)
    if isinstance(w, Mxfp4Weight):
        return dequantize_experts(w, expert_ids, dtype)
    ids = jnp.clip(expert_ids.astype(jnp.int32), 0, num_experts(w) - 1)
    if isinstance(w, QuantizedWeight):
        check_expert_weight(w)
        return dequantize(jax.tree.map(lambda a: jnp.take(a, ids, axis=0), w), dtype)
    return widen(jnp.take(w, ids, axis=0)).astype(dtype)


def whole(w: ExpertWeight, dtype: jnp.dtype) -> jax.Array:
    """The whole stack [E, N, K] in `dtype`."""
    w = resolve(w)
    if isinstance(w, Mxfp4Weight):
        return dequantize_experts(w, jnp.arange(num_experts(w)), dtype)
    if isinstance(w, QuantizedWeight):
        check_expert_weight(w)
        return dequantize(w, dtype)
    return widen(w).astype(dtype)


def grouped_matmul(lhs: jax.Array, w: ExpertWeight, group_sizes: jax.Array, backend: str = "xla",
                   dtype: jnp.dtype | None = None) -> jax.Array:
    """lhs [M, K] sorted by expert (group e: the next group_sizes[e] rows; rows past their sum
    get 0) times each row's expert -> [M, N] in lhs.dtype. `dtype`: the operands' dtype (float32
    accumulation); None: lhs's. See the module docstring for the paths."""
    dtype = dtype or lhs.dtype
    if (backend in PALLAS_BACKENDS and isinstance(w, LayerStack) and isinstance(w.stack, jax.Array)
            and w.stack.dtype == dtype and pallas_supported(lhs.shape[1], w.stack.shape[-2])):
        # the kernel reads the layer's experts in the whole stack: a slice handed to it is likely a copy
        out = pallas_grouped_matmul(lhs.astype(dtype), w.stack, group_sizes.astype(jnp.int32), w.layer,
                                    interpret=backend == PALLAS_INTERPRET)
        return out.astype(lhs.dtype)
    w = resolve(w)
    num_blocks = num_row_blocks(lhs.shape[0], num_experts(w), XLA_BLOCK_M)  # static
    if is_packed(w) and num_blocks >= num_experts(w):  # more blocks than experts: unpack each expert once
        w = whole(w, dtype)
    if backend in PALLAS_BACKENDS and not is_packed(w) and pallas_supported(lhs.shape[1], w.shape[1]):
        out = pallas_grouped_matmul(lhs.astype(dtype), widen(w).astype(dtype), group_sizes.astype(jnp.int32),
                                    interpret=backend == PALLAS_INTERPRET)
        return out.astype(lhs.dtype)
    return _blocked(lhs, w, group_sizes, dtype)


def _blocked(lhs: jax.Array, w: ExpertWeight, group_sizes: jax.Array, dtype: jnp.dtype) -> jax.Array:
    m = lhs.shape[0]
    expert, start, rows = align_block_size(group_sizes, m, XLA_BLOCK_M)  # [B] each
    offs = jnp.arange(XLA_BLOCK_M, dtype=jnp.int32)
    row_ids = start[:, None] + offs  # [B, bm]
    x = jnp.take(lhs, jnp.clip(row_ids, 0, m - 1), axis=0).astype(dtype)  # [B, bm, K]
    out = jnp.einsum("bmk,bnk->bmn", x, take_experts(w, expert, dtype), preferred_element_type=jnp.float32)
    dest = jnp.where(offs < rows[:, None], row_ids, m).reshape(-1)  # rows not stored go out of range
    result = jnp.zeros((m, out.shape[-1]), lhs.dtype)
    return result.at[dest].set(out.reshape(-1, out.shape[-1]).astype(lhs.dtype), mode="drop")
