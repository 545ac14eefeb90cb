"""One quantized Linear of an HF checkpoint -> a host `QuantizedWeight`, repacked once at load.

Every reader returns the weight in the model's [in, out] orientation: unsigned
integer values [K, N], scales and zero points [G, N] (`qweight.pack_int` then
packs 4-bit values two to a byte and sorts act-order rows), or fp8 / int8 values
[K, N] with per-output-channel scales [1, N].
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.formats import QuantSpec
from jaxserve.quantization.qweight import QuantizedWeight, fp8_block, pack_int

TensorGetter = Callable[[str], np.ndarray]  # raises KeyError when absent
LinearReader = Callable[[str, tuple[int, int]], QuantizedWeight]  # (prefix, (K, N)) -> host weight
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ packs columns 0,2,4,6,1,3,5,7 into nibbles 0..7


def unpack_cols(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, C] -> [R, C * 32 / bits]: value j of word c is column c * (32 / bits) + j."""
    per = 32 // bits
    words = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(per, dtype=np.int64) * bits
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1).astype(np.uint8)


def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, C] -> [R * 32 / bits, C]: value j of word r is row r * (32 / bits) + j."""
    return np.ascontiguousarray(unpack_cols(packed.T, bits).T)


def _groups(spec: QuantSpec, k: int) -> int:
    return 1 if spec.group_size in (-1, 0) else k // spec.group_size


def _gptq(spec: QuantSpec, get: TensorGetter, prefix: str, k: int, n: int, dtype) -> QuantizedWeight:
    q = unpack_rows(np.asarray(get(f"{prefix}.qweight")), spec.bits)[:k]  # [K, N]
    zeros = unpack_cols(np.asarray(get(f"{prefix}.qzeros")), spec.bits)[:, :n].astype(np.int32)
    zeros = (zeros + spec.zeros_offset) & ((1 << spec.bits) - 1)  # v1 stores zero - 1 (wrapping)
    scales = np.asarray(get(f"{prefix}.scales"), np.float32)
    g_idx = None
    if spec.desc_act:
        g_idx = np.asarray(get(f"{prefix}.g_idx"), np.int64)
    return pack_int(q, scales, zeros, g_idx, spec.bits, dtype)


def _awq(spec: QuantSpec, get: TensorGetter, prefix: str, k: int, n: int, dtype) -> QuantizedWeight:
    order = np.asarray(AWQ_REVERSE_ORDER)

    def unpack(name: str) -> np.ndarray:
        vals = unpack_cols(np.asarray(get(f"{prefix}.{name}")), 4)
        return vals.reshape(vals.shape[0], -1, 8)[:, :, order].reshape(vals.shape[0], -1)

    scales = np.asarray(get(f"{prefix}.scales"), np.float32)
    zeros = unpack("qzeros") if not spec.symmetric else np.full(scales.shape, 8, np.uint8)
    return pack_int(unpack("qweight"), scales, zeros, None, 4, dtype)


def _ct_packed(spec: QuantSpec, get: TensorGetter, prefix: str, k: int, n: int, dtype) -> QuantizedWeight:
    # weight_packed i32 [N, K * bits / 32] (values offset by 2^(bits-1)); scales [N, G]; asymmetric
    # zero points i32 [N * bits / 32, G] packed along N, signed as the values.
    offset = 1 << (spec.bits - 1)
    q = unpack_cols(np.asarray(get(f"{prefix}.weight_packed")), spec.bits)[:, :k].T  # [K, N], offset
    scales = np.asarray(get(f"{prefix}.weight_scale"), np.float32).T  # [G, N]
    if spec.symmetric:
        zeros = np.full(scales.shape, offset, np.uint8)
    else:
        zeros = unpack_rows(np.asarray(get(f"{prefix}.weight_zero_point")), spec.bits)[:n].T  # [G, N], offset
    g_idx = _maybe(get, f"{prefix}.weight_g_idx")
    return pack_int(q, scales, zeros, None if g_idx is None else np.asarray(g_idx, np.int64), spec.bits, dtype)


def _maybe(get: TensorGetter, name: str) -> np.ndarray | None:
    try:
        return get(name)
    except KeyError:
        return None


def _w8a8(spec: QuantSpec, get: TensorGetter, prefix: str, k: int, n: int, dtype) -> QuantizedWeight:
    values = np.asarray(get(f"{prefix}.weight")).T  # [K, N] int8 or float8_e4m3fn
    scale = np.asarray(get(f"{prefix}.weight_scale"), np.float32).reshape(-1)
    scales = np.broadcast_to(scale, (n,)).reshape(1, n).copy()  # per tensor or per channel
    input_scale = None
    if spec.static_input:
        input_scale = np.asarray(get(f"{prefix}.input_scale"), np.float32).reshape(-1).max()
    return QuantizedWeight(np.ascontiguousarray(values), scales, None, None,
                           None if input_scale is None else np.float32(input_scale), spec.scheme)


def _fp8_block(spec: QuantSpec, get: TensorGetter, prefix: str, k: int, n: int, dtype) -> QuantizedWeight:
    return fp8_block(np.asarray(get(f"{prefix}.weight")), np.asarray(get(f"{prefix}.weight_scale_inv"), np.float32),
                     spec.block_size)


def linear_reader(spec: QuantSpec, get: TensorGetter, dtype: jnp.dtype) -> LinearReader:
    """A reader for `spec`'s checkpoint: (tensor prefix, (K, N)) -> host QuantizedWeight."""
    if spec.method == "gptq":
        read = _gptq
    elif spec.method == "awq":
        read = _awq
    elif spec.ct_format == "pack-quantized":
        read = _ct_packed
    elif spec.scheme == "fp8_block":
        read = _fp8_block
    else:
        read = _w8a8

    def reader(prefix: str, shape: tuple[int, int]) -> QuantizedWeight:
        k, n = shape
        try:
            w = read(spec, get, prefix, k, n, dtype)
        except KeyError as e:
            raise ValueError(f"{prefix}: missing tensor {e} for a {spec.method} checkpoint") from None
        if w.shape != (k, n):
            raise ValueError(f"{prefix}: quantized weight is {w.shape} ([in, out]), expected {(k, n)}")
        return w

    reader.spec = spec  # the family readers of packed expert stacks read the format (block sizes) here
    return reader
