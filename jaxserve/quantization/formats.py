"""Which quantization a checkpoint uses: config.json's `quantization_config`, as vLLM reads it.

    quant_method          what is read (per Linear, HF orientation [out, in])
    awq                   AutoAWQ GEMM: qweight i32 [in, out/8], qzeros i32 [groups, out/8], scales [groups, out]
    gptq                  AutoGPTQ / GPTQModel: qweight i32 [in*bits/32, out], qzeros i32 [groups, out*bits/32],
                          scales [groups, out], g_idx [in] (desc_act); 4 or 8 bits, sym or not
    compressed-tensors    llm-compressor: pack-quantized (W4A16: weight_packed, weight_scale,
                          weight_zero_point), int-quantized (W8A8 int8), float-quantized (FP8, dynamic or
                          static input_scale)
    mxfp4                 gpt-oss: MoE experts *_blocks u8 [E, N, K/32, 16] (e2m1 pairs), *_scales u8 [E, N, K/32]
                          (e8m0); the rest float (quantization/mxfp4.py)
    fp8                   vLLM's fp8 checkpoints: weight e4m3 [out, in], weight_scale, input_scale (static);
                          block-wise (weight_block_size [128, 128]): weight e4m3 [out, in], weight_scale_inv
                          f32 [out / 128, in / 128] (Qwen3-*-FP8, DeepSeek-V3; transformers' FineGrainedFP8)

`--quantization` (EngineArgs.quantization) forces or checks the method: given with a
quantized checkpoint it must name the checkpoint's method; given with a float
checkpoint it must be a quantize-on-load method (int8, fp8). `gguf` applies to a .gguf file only
(weights/gguf_linear.py) and is refused here, for a Hugging Face directory.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.constants import (QUANTIZATION_CHECKPOINT_METHODS, QUANTIZATION_GGUF, QUANTIZATION_ON_LOAD_METHODS,
                                QUANTIZATIONS)

# The list of `--quantization` methods is defined once, with the other flags' names, in
# jaxserve/constants.py (no JAX there: the CLI reads it); every place here and in sizing reads these.
CHECKPOINT_METHODS = QUANTIZATION_CHECKPOINT_METHODS
ON_LOAD_METHODS = QUANTIZATION_ON_LOAD_METHODS
GGUF = QUANTIZATION_GGUF  # a .gguf file's blocks kept (quantization/gguf_packed.py)
METHODS = QUANTIZATIONS
# How `worker/sizing` counts a method's weights when only its name is known: the QuantizedWeight
# scheme it most often loads into (compressed-tensors: its W4A16 pack-quantized form, the hub's
# most common; its int8 / fp8 forms store 8 bits a weight, so this undercounts those by ~2x).
BLOCK_MXFP4 = 32  # elements per e8m0 scale
SIZING_SCHEMES = {"int8": "int8", "fp8": "fp8", "awq": "w4a16", "gptq": "w4a16", "compressed-tensors": "w4a16",
                  "mxfp4": "mxfp4", "gguf": "gguf"}
assert set(SIZING_SCHEMES) == set(METHODS)


@dataclass(frozen=True)
class QuantSpec:
    """One checkpoint's weight format, normalised."""
    method: str  # one of CHECKPOINT_METHODS
    scheme: str  # the QuantizedWeight scheme it loads into: w4a16, w8a16, int8, fp8
    bits: int = 4
    group_size: int = -1  # -1: one group over the whole input (per channel)
    symmetric: bool = True
    desc_act: bool = False  # GPTQ act-order: a g_idx per layer
    zeros_offset: int = 0  # GPTQ v1 stores zero - 1
    static_input: bool = False  # fp8 / int8: a checkpoint input_scale instead of per-token scales
    ct_format: str = ""  # compressed-tensors: pack-quantized, int-quantized, float-quantized
    block_size: tuple[int, int] | None = None  # block-wise fp8: (out, in) elements per weight_scale_inv


def _unsupported(method: object) -> ValueError:
    return ValueError(f"quantization: method {method!r} is not supported; supported checkpoint methods: "
                      f"{', '.join(CHECKPOINT_METHODS)}; applied at load: {', '.join(ON_LOAD_METHODS)}")


def detect(hf_config: dict, requested: str | None) -> QuantSpec | None:
    """The checkpoint's QuantSpec (None: a float checkpoint), checked against `requested`."""
    if requested == GGUF:
        raise ValueError("quantization: 'gguf' keeps a .gguf file's quantized tensors as their blocks; "
                         "this model is a Hugging Face directory, not a .gguf file")
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not qc:
        if requested is not None and requested not in ON_LOAD_METHODS:
            raise ValueError(f"quantization: {requested!r} needs a checkpoint quantized with it (config.json "
                             f"has no quantization_config); a float checkpoint takes {', '.join(ON_LOAD_METHODS)}")
        return None
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_METHODS:
        raise _unsupported(qc.get("quant_method"))
    if requested is not None and requested != method:
        raise ValueError(f"quantization: {requested!r} was asked for but the checkpoint is quantized with "
                         f"{method!r} (config.json quantization_config)")
    return {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors, "fp8": _fp8,
            "mxfp4": _mxfp4}[method](qc)


def _awq(qc: dict) -> QuantSpec:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or qc.get("bits", qc.get("w_bit", 4)) != 4:
        raise ValueError(f"quantization_config: AWQ {version} with {qc.get('bits')} bits; only 4-bit GEMM is supported")
    return QuantSpec("awq", "w4a16", 4, int(qc.get("group_size", qc.get("q_group_size", 128))),
                     symmetric=not qc.get("zero_point", True))


def _gptq(qc: dict) -> QuantSpec:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits: GPTQ with {bits} bits; supported: 4, 8")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r}: supported gptq, gptq_v2")
    return QuantSpec("gptq", "w4a16" if bits == 4 else "w8a16", bits, int(qc.get("group_size", 128)),
                     bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), 1 if fmt == "gptq" else 0)


def _compressed_tensors(qc: dict) -> QuantSpec:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: {len(groups)} groups; one scheme for all "
                         "Linear layers is supported")
    scheme = next(iter(groups.values()))
    w, act = scheme.get("weights") or {}, scheme.get("input_activations")
    fmt = str(scheme.get("format") or qc.get("format", ""))
    bits, kind, strategy = int(w.get("num_bits", 8)), w.get("type", "int"), w.get("strategy", "channel")
    if fmt == "pack-quantized" and kind == "int" and act is None and bits in (4, 8):
        size = int(w["group_size"]) if strategy == "group" else -1
        return QuantSpec("compressed-tensors", "w4a16" if bits == 4 else "w8a16", bits, size,
                         bool(w.get("symmetric", True)), ct_format=fmt)
    static = act is not None and not act.get("dynamic", True)
    if fmt == "int-quantized" and kind == "int" and bits == 8 and act is not None:
        return QuantSpec("compressed-tensors", "int8", 8, static_input=static, ct_format=fmt)
    if fmt == "float-quantized" and kind == "float" and bits == 8 and strategy in ("channel", "tensor"):
        return QuantSpec("compressed-tensors", "fp8", 8, static_input=static, ct_format=fmt)
    raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} with {kind}{bits} weights "
                     f"({strategy}) is not supported; supported: pack-quantized W4A16/W8A16, "
                     "int-quantized W8A8 int8, float-quantized FP8 (per channel or tensor)")


def _mxfp4(qc: dict) -> QuantSpec:
    """gpt-oss: MoE experts as *_blocks / *_scales (quantization/mxfp4.py); every other Linear is float
    (its modules_to_not_convert), so the loader reads no Linear through hf_linear."""
    return QuantSpec("mxfp4", "mxfp4", 4, BLOCK_MXFP4)


def _fp8(qc: dict) -> QuantSpec:
    block = qc.get("weight_block_size")
    if block:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size: must be two positive ints [out, in], got {block!r}")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("quantization_config.activation_scheme: block-wise fp8 supports 'dynamic' only, got "
                             f"{qc.get('activation_scheme')!r}")
        return QuantSpec("fp8", "fp8_block", 8, block_size=(block[0], block[1]))
    return QuantSpec("fp8", "fp8", 8, static_input=qc.get("activation_scheme", "dynamic") == "static")
