"""`matmul(x, w)`: the one entry the model calls for every weight, float or quantized.

The path is picked here, never in the model (DESIGN.md rule 9):

    float weight           x @ w; with `dots` (the CPU's --dtype auto, in steps of 64+ tokens) both
                           operands converted to bfloat16 in the program and accumulated in
                           float32: XLA:CPU's bfloat16 dot is 1.2x float32's at 64 rows and 1.8x
                           at 512 on a Zen 4 host (a weight stored as bfloat16 is slower than
                           either: its dot takes another path)
    int8  (W8A8)           per-token int8 x, int8 x int8 dot, int32 accumulate, rescale; with
                           `dots`, x in bfloat16 times the int8 values as bfloat16 (W8A16)
    fp8   (W8A8)           x scaled to float8_e4m3fn (per token, or the checkpoint's static
                           per-tensor scale), an f8 x f8 dot in XLA with float32 accumulation
                           (cuBLASLt's fp8 GEMM on Hopper), rescaled by both scales
    fp8_block              block-wise FP8 weights (weight only): the e4m3 values times their block
                           scales, dequantized to x's dtype inside the program, then a float dot
                           (XLA fuses the convert and scale into the dot's operand on CPU; on GPU
                           the same XLA path for now)
    gguf (GGUFWeight)      a GGUF file's blocks, one int8 a value and their scales
                           (gguf_packed.py): x @ dequantize(w).T in the program
    w4a16 / w8a16          GPU and M <= DECODE_MAX_ROWS: the Pallas (Triton) dequantizing
                           kernel `pallas_kernels.w4a16_matmul` (4-bit; under tensor
                           parallelism on each device's shard, `w4a16_kernel`); otherwise
                           XLA: dequantize to x's dtype in the program, then a float dot

Why int8 on the CPU quantizes both operands: XLA:CPU does not fuse an int8 -> float
convert into its dot, so int8 weights with float activations would be converted in
memory every step; an int8 x int8 dot is native and ~1.6x faster than float32 here
(BENCHMARKS.md). llama.cpp does the same with its Q8 activations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.quantization import gguf_packed
from jaxserve.quantization.observed import Observed, observe
from jaxserve.quantization.qweight import FP8_MAX, QuantizedWeight, dequantize

DECODE_MAX_ROWS = 64  # the Pallas W4A16 kernel's range; larger M is compute-bound: XLA's dot


def matmul(x: jax.Array, w: jax.Array | QuantizedWeight | Observed, dots: jnp.dtype | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x.dtype. `dots` (float and int8 weights): both operands
    rounded to that dtype, the products accumulated in float32 (llama.run_layers' bf16_dots_from)."""
    if isinstance(w, Observed):  # calibration: report x's statistics, then the float product
        observe(x, w)
        return x @ w.weight
    if isinstance(w, gguf_packed.GGUFWeight):  # a GGUF's blocks (--quantization gguf): widened in the dot
        return gguf_packed.matmul(x, w) if dots is None else _dot(x.astype(dots), gguf_packed.dequantize(w, dots),
                                                                   jnp.float32, b_axis=1).astype(x.dtype)
    if not isinstance(w, QuantizedWeight):
        if dots is None or x.dtype == w.dtype == dots:
            return x @ w
        return _dot(x.astype(dots), w.astype(dots), jnp.float32).astype(x.dtype)
    if w.scheme == "int8":
        return _int8(x, w) if dots is None else _int8_weights(x, w, dots)
    if w.scheme == "fp8":
        return _fp8(x, w)
    if w.scheme == "fp8_block":
        return x @ dequantize(w, x.dtype)
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    rows = x.size // x.shape[-1]
    xla = lambda x: x @ dequantize(w, x.dtype)  # noqa: E731
    if not _kernel_fits(w, rows):
        return xla(x)
    # Chosen when the program is lowered, for the platform it is lowered for: an export for
    # cuda from a CPU host gets the kernel, a CPU run the XLA dot.
    return jax.lax.platform_dependent(x, cuda=lambda x: w4a16_kernel(x, w), default=xla)


def matmul_transposed(x: jax.Array, w: jax.Array, dots: jnp.dtype | None = None) -> jax.Array:
    """x [..., K] @ w.T for a float w [N, K] stored a row per output (a tied embedding as the LM head).
    With `dots`, both operands converted and contracted on w's K as stored: converting w.T instead
    made XLA:CPU copy the transpose (the head's bfloat16 slices then ran no faster than float32)."""
    if dots is None:
        return x @ w.T
    return _dot(x.astype(dots), w.astype(dots), jnp.float32, b_axis=1).astype(x.dtype)


def has_columns(w: object) -> bool:
    """Whether `columns` slices this weight: a float array, or per-channel int8."""
    return isinstance(w, jax.Array) or (isinstance(w, QuantizedWeight) and w.scheme == "int8"
                                        and w.scales.shape[-2] == 1)


def columns(w: jax.Array | QuantizedWeight, start: jax.Array, size: int) -> jax.Array | QuantizedWeight:
    """Columns [start, start + size) of a [K, N] weight (start may be traced): a float weight's, or an
    int8 weight's values and per-column scales, which matmul then takes as it takes the whole."""
    if not has_columns(w):
        raise ValueError(f"columns: only float and per-channel int8 weights are sliced, got {w.scheme}")
    if not isinstance(w, QuantizedWeight):
        return jax.lax.dynamic_slice_in_dim(w, start, size, 1)
    return dataclasses.replace(w, values=jax.lax.dynamic_slice_in_dim(w.values, start, size, 1),
                               scales=jax.lax.dynamic_slice_in_dim(w.scales, start, size, 1))


def model_mesh(a: jax.Array, axis: str = "model"):
    """The jit's mesh when `a` is placed over `axis` of more than one device (read from its aval),
    else None: where a Pallas kernel, which has no partitioning rule, must run inside shard_map."""
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if mesh is None or dict(mesh.shape).get(axis, 1) == 1:
        return None
    return mesh


def w4a16_kernel(x: jax.Array, w: QuantizedWeight, interpret: bool = False) -> jax.Array:
    """x [..., K] @ w through the Pallas kernel. A tensor-parallel weight (`w.split`) runs it on each
    device's shard inside `shard_map` (a custom kernel has no partitioning rule, so XLA would gather
    the whole weight onto every device): column-split, each device's N columns of the output;
    row-split, each device's K rows times its slice of x, then a psum over the axis."""
    from pallas_kernels.w4a16_matmul import w4a16_matmul

    def local(x2, values, scales, zeros):
        return w4a16_matmul(x2, values, scales, zeros, group_size=w.group_size, interpret=interpret)

    x2 = x.reshape(-1, x.shape[-1])
    if w.split is None:
        out = local(x2, w.values, w.scales, w.zeros)
    else:
        mesh, axis, kind = w.split
        if kind == "column":
            body, x_spec, w_spec, out_spec = local, P(), P(None, axis), P(None, axis)
        else:
            body, x_spec, w_spec, out_spec = (lambda *a: jax.lax.psum(local(*a), axis)), P(None, axis), P(axis), P()
        # (check_vma off: a pallas_call's output does not say how it varies over the mesh)
        out = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec, w_spec, w_spec), out_specs=out_spec,
                            check_vma=False)(x2, w.values, w.scales, w.zeros)
    return out.reshape(*x.shape[:-1], -1)


def _kernel_fits(w: QuantizedWeight, rows: int) -> bool:
    """The 4-bit kernel's sizes, on each device's shard of a tensor-parallel weight (a row split
    must keep whole groups per device; per-channel scales, one group, cannot be split)."""
    from pallas_kernels.w4a16_matmul import supported

    if w.scheme != "w4a16" or rows > DECODE_MAX_ROWS or w.values.ndim != 2:
        return False
    k, n = w.shape[-2:]
    if w.split is not None:
        mesh, axis, kind = w.split
        size = mesh.shape[axis]
        if kind == "column":
            n //= size
        elif w.scales.shape[-2] % size:
            return False
        else:
            k //= size
    return supported(k, n, w.group_size)


def _dot(a: jax.Array, b: jax.Array, acc: jnp.dtype, b_axis: int = 0) -> jax.Array:
    """a's last axis contracted with b's axis b_axis (0: b is [K, N]; 1: b is [N, K]), summed in acc."""
    return jax.lax.dot_general(a, b, (((a.ndim - 1,), (b_axis,)), ((), ())), preferred_element_type=acc)


def _int8(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    xq = jnp.round(xf * (127.0 / jnp.where(amax > 0, amax, 1.0))).astype(jnp.int8)  # |xq| <= 127
    acc = _dot(xq, w.values, jnp.int32)
    return (acc.astype(jnp.float32) * (amax / 127.0) * w.scales[0]).astype(x.dtype)


def _int8_weights(x: jax.Array, w: QuantizedWeight, dots: jnp.dtype) -> jax.Array:
    """int8 weights under `dots` (the CPU's large steps): x in bfloat16, not quantized, times the int8
    values converted to bfloat16 (exact: |value| <= 127), float32 sums, then the weight's scales.
    On a Zen 4 host 1.1x the int8 x int8 dot at 64 rows and 1.3x at 128-512, and closer to float."""
    return (_dot(x.astype(dots), w.values.astype(dots), jnp.float32) * w.scales[0]).astype(x.dtype)


def _fp8(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    xf = x.astype(jnp.float32)
    if w.input_scale is None:  # dynamic, one scale per token
        amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
        x_scale = jnp.where(amax > 0, amax, 1.0) / FP8_MAX
    else:
        x_scale = w.input_scale.astype(jnp.float32)
    xq = jnp.clip(xf / x_scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    acc = _dot(xq, w.values, jnp.float32)
    return (acc * x_scale * w.scales[0]).astype(x.dtype)
