"""Tiny quantized HF checkpoints for tests/test_quantized_checkpoints.py.

compressed-tensors checkpoints are made by the real library (its PackedQuantization /
NaiveQuantization compressors and its calculate_qparams). AutoGPTQ / GPTQModel and
AutoAWQ cannot be installed here (GPTQModel pulls torch 2.14 and the CUDA stack into
the shared environment, AutoAWQ needs triton and predates transformers 5), so their
tensors are packed here following the libraries' own pack code:
AutoGPTQ `QuantLinear.pack` (qweight rows packed along in-features, qzeros stored
zero - 1 along out-features, g_idx) and AutoAWQ `WQLinear_GEMM.from_linear` (columns
packed in the order 0, 2, 4, 6, 1, 3, 5, 7). Each function returns the HF tensors of
one Linear and the float weight [out, in] the quantized one stands for (the
reference model's weight).
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def rtn(w: np.ndarray, bits: int, group: int, sym: bool, g_idx: np.ndarray) -> tuple[np.ndarray, ...]:
    """Round-to-nearest group quantization of w [out, in] -> q [in, out], scales, zeros [G, out]."""
    wt = w.T.astype(np.float64)  # [in, out]
    num_groups, maxq = wt.shape[0] // group, (1 << bits) - 1
    scales, zeros = np.zeros((num_groups, wt.shape[1])), np.zeros((num_groups, wt.shape[1]))
    for g in range(num_groups):
        rows = wt[g_idx == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        if sym:
            scales[g] = np.maximum(np.maximum(-lo, hi), 1e-8) * 2 / maxq
            zeros[g] = (maxq + 1) // 2
        else:
            scales[g] = np.maximum(hi - lo, 1e-8) / maxq
            zeros[g] = np.round(-lo / scales[g])
    scales = scales.astype(np.float16).astype(np.float64)
    q = np.clip(np.round(wt / scales[g_idx]) + zeros[g_idx], 0, maxq).astype(np.int64)
    return q, scales.astype(np.float16), zeros.astype(np.int64)


def _pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), np.uint32)
    for j in range(per):
        out |= (q[j::per].astype(np.uint32) << (bits * j))
    return out.view(np.int32)


def gptq_linear(w: np.ndarray, bits: int, group: int, sym: bool, desc_act: bool, rng) -> tuple[dict, np.ndarray]:
    k = w.shape[1]
    g_idx = np.arange(k) // group
    if desc_act:
        g_idx = g_idx[np.argsort(rng.random(k))]  # act order: groups over permuted rows
    q, scales, zeros = rtn(w, bits, group, sym, g_idx)
    ref = ((q - zeros[g_idx]) * scales.astype(np.float64)[g_idx]).T
    tensors = {"qweight": _pack_rows(q, bits), "qzeros": _pack_rows(((zeros - 1) & ((1 << bits) - 1)).T, bits).T.copy(),
               "scales": scales, "g_idx": g_idx.astype(np.int32)}
    return tensors, ref.astype(np.float32)


def awq_linear(w: np.ndarray, group: int, rng) -> tuple[dict, np.ndarray]:
    g_idx = np.arange(w.shape[1]) // group
    q, scales, zeros = rtn(w, 4, group, False, g_idx)
    ref = ((q - zeros[g_idx]) * scales.astype(np.float64)[g_idx]).T

    def pack(v: np.ndarray) -> np.ndarray:  # [R, N] -> [R, N // 8], AutoAWQ's column order
        out = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
        for i, col in enumerate(AWQ_ORDER):
            out |= v[:, col::8].astype(np.uint32) << (4 * i)
        return out.view(np.int32)

    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales}, ref.astype(np.float32)


def ct_config(preset: str, group: int | None = None, sym: bool = True) -> dict:
    """config.json's quantization_config, as the library writes it."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group is not None:
        scheme.weights.group_size, scheme.weights.symmetric = group, sym
    fmt = {"W4A16": "pack-quantized", "W8A8": "int-quantized"}.get(preset, "float-quantized")
    return QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"]).model_dump()


def ct_linear(w: np.ndarray, preset: str, group: int | None = None, sym: bool = True) -> tuple[dict, np.ndarray]:
    """compressed-tensors' own quantization and compressor for one Linear; the reference is the
    library's own decompression (pack-quantized) or its dequantize (int8 / fp8)."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group is not None:
        scheme.weights.group_size, scheme.weights.symmetric = group, sym
    wt = torch.from_numpy(w)
    args = scheme.weights
    view = wt.reshape(wt.shape[0], -1, args.group_size) if args.group_size else wt[:, None, :]
    scale, zp = calculate_qparams(view.amin(-1), view.amax(-1), args)
    if args.strategy == "channel":
        scale, zp = scale.reshape(-1, 1), zp.reshape(-1, 1)
    state = {"weight": wt, "weight_scale": scale, "weight_zero_point": zp}
    if preset == "W4A16":
        out = PackedQuantizationCompressor.compress(state, scheme)
        ref = PackedQuantizationCompressor.decompress(out, scheme)["weight"]
    else:
        out = NaiveQuantizationCompressor.compress(state, scheme)
        ref = dequantize(x_q=out["weight"], scale=scale, zero_point=zp, args=args)
    out = {k: v for k, v in out.items() if not (sym and k == "weight_zero_point")}
    return out, ref.float().numpy()


def fp8_linear(w: np.ndarray, static: bool) -> tuple[dict, np.ndarray]:
    """vLLM's fp8 checkpoint layout: e4m3 weight [out, in], a per-tensor weight_scale, input_scale."""
    scale = np.float32(np.abs(w).max() / 448.0)
    q = torch.from_numpy(w / scale).to(torch.float8_e4m3fn)
    out = {"weight": q, "weight_scale": torch.tensor(scale)}
    if static:
        out["input_scale"] = torch.tensor(np.float32(0.05))
    return out, (q.float() * scale).numpy()


def finegrained_fp8_checkpoint(float_dir: str, out_dir: str, block_size=(128, 128)) -> None:
    """Block-wise FP8 (quant_method fp8, weight_block_size, weight_scale_inv) of a saved float model,
    written by transformers itself: FineGrainedFP8Config quantizes on load and save_pretrained writes
    the hub layout. Its quantizer refuses to run without a GPU ("A GPU or XPU is needed for FP8
    quantization") although its quantization (integrations.finegrained_fp8.Fp8Quantize) is plain
    torch; only that environment check is skipped here."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    try:
        model = AutoModelForCausalLM.from_pretrained(
            float_dir, quantization_config=FineGrainedFP8Config(weight_block_size=tuple(block_size)))
        model.save_pretrained(out_dir)
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check


def finegrained_fp8_reference(fp8_dir: str):
    """transformers' own dequantized float32 model of a block-wise FP8 checkpoint."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(
        fp8_dir, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32).eval()
