"""Every tensor type llama.cpp's common quantizations write (`llama-quantize` Q4_0 ... Q6_K, IQ4_NL,
IQ4_XS, and BF16 / F16 / F32 files) loads from a GGUF file to the values the `gguf` package's own
`gguf.quants.dequantize` gives for the same bytes, placed as the model reads them (the embedding
as is, a layer's projection transposed to [in, out]).

The bytes: `gguf.quants.quantize` of random values where the package can quantize the type (F32,
F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: the loaded values are then also within the type's rounding
of the originals), and for the types it can only dequantize (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS) random blocks laid out as its dequantizer reads them, their float16 scales set to finite
values (random bits would hold infinities and NaNs).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from gguf import GGMLQuantizationType as Q

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS = 32, 256, 256, 4, 2  # rows of 256: the K-quants' block
QUANTIZED = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# the type's relative error bound against the original values (a block's largest magnitude)
ROUNDING = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q5_0: 0.07, Q.Q5_1: 0.07, Q.Q4_0: 0.15,
            Q.Q4_1: 0.15}
# dequantize-only types: byte offsets of each block's float16 scale fields (gguf/quants.py's layouts)
CRAFTED = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,),
           Q.IQ4_XS: (0,)}


def _bytes(qtype: Q, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes in `qtype` [rows, row bytes] (or its float array for F32 / F16)."""
    if qtype in QUANTIZED:
        return gguf.quants.quantize(values, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in CRAFTED[qtype]:
        scale = rng.uniform(0.005, 0.05, (rows, cols // block)).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _write(path: Path, qtype: Q, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A one-layer qwen2 GGUF whose embedding and ffn_gate are of `qtype` (the rest F32); returns
    name -> (original values, bytes written)."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("head_count", HEADS), ("head_count_kv", KV_HEADS),
                       ("layer_norm_rms_eps", 1e-6), ("vocab_size", VOCAB)]:
        getattr(w, f"add_{key}")(value)
    hd = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * hd, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * hd, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    written = {}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if name in ("token_embd.weight", "blk.0.ffn_gate.weight"):
            raw = _bytes(qtype, values, rng)
            written[name] = (values, raw)
            w.add_tensor(name, raw, raw_shape=shape if qtype in (Q.F32, Q.F16) else None,
                         raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.mark.parametrize("qtype", QUANTIZED + list(CRAFTED), ids=lambda q: q.name)
def test_each_type_loads_as_gguf_dequantizes_it(tmp_path, qtype):
    from jaxserve.weights import gguf_file

    path = tmp_path / f"{qtype.name}.gguf"
    written = _write(path, qtype, np.random.default_rng(int(qtype)))
    header, _ = gguf_file.read_header(path)
    assert header.tensors["token_embd.weight"].tensor_type == qtype  # the file really holds the type
    params = gguf_file.load_gguf(header, path, jnp.float32, progress=False)
    got = {"token_embd.weight": np.asarray(params["embed"]),
           "blk.0.ffn_gate.weight": np.asarray(params["layers"]["w_gate"][0]).T}  # [in, out] -> the file's [out, in]
    for name, (values, raw) in written.items():
        want = gguf.quants.dequantize(raw, qtype).reshape(values.shape).astype(np.float32)
        assert np.isfinite(want).all() and np.abs(want).max() > 0, name
        np.testing.assert_array_equal(got[name], want, err_msg=f"{qtype.name} {name}")
        if qtype in ROUNDING:  # quantized by gguf: the values are the originals, rounded
            assert np.abs(got[name] - values).max() <= ROUNDING[qtype] * np.abs(values).max(), name


def test_a_tensor_of_a_type_gguf_does_not_know_is_named(tmp_path):
    """A type id the gguf package lacks (a newer llama.cpp quantization) fails naming the tensor and the
    id, not as an unreadable file."""
    from jaxserve.weights import gguf_file

    path = tmp_path / "unknown.gguf"
    _write(path, Q.Q8_0, np.random.default_rng(0))
    raw = bytearray(path.read_bytes())
    name = b"blk.0.ffn_gate.weight"
    at = raw.index(name) + len(name)  # then n_dims (u32), the dims (u64 each), the type id (u32)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at:type_at + 4], "little") == Q.Q8_0
    raw[type_at:type_at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_gate\.weight' has GGML type id 250"):
        gguf_file.read_header(path)
