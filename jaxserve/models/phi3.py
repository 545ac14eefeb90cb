"""Phi-3 / Phi-3.5 / Phi-4 (`Phi3ForCausalLM`: Phi-3-mini/medium 4k and 128k, Phi-3.5-mini, Phi-4,
Phi-4-mini), as transformers' modeling_phi3 computes it: Llama's layer with

    attention   q, k and v in one fused projection `self_attn.qkv_proj.weight` [nq*hd + 2*nkv*hd, hidden]
                (rows: q, then k, then v); RoPE over the first head_dim * partial_rotary_factor dims
                (Phi-4-mini: 0.75); LongRoPE scaling for the 128k models (models/longrope.py says which
                factor set a request uses)
    MLP         gate and up in one `mlp.gate_up_proj.weight` [2 * inter, hidden] (rows: gate, then up),
                SwiGLU as Llama's

The fused tensors are read as the checkpoint has them and split into Llama's leaves (wq/wk/wv,
w_gate/w_up) as they load, so tensor parallelism splits heads and the MLP width as for Llama, and
LoRA adapters and --quantization apply unchanged. A GGUF file (llama.cpp's `phi3`) holds the same
fused tensors as attn_qkv / ffn_up (weights/gguf_file.py).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import ATTENTION_TENSORS, MLP_TENSORS, _param_shapes, dense_mlp, dense_partition_rules
from jaxserve.models.tensor_cuts import Cut, with_cuts

QKV = "self_attn.qkv_proj.weight"
GATE_UP = "mlp.gate_up_proj.weight"


def config_fields(hf: Mapping, arch: str) -> dict:
    """partial_rotary_factor (transformers >= 5 keeps it in rope_parameters); no q/k/v bias."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported for {arch} (silu only)")
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if not 0 < factor <= 1:
        raise ValueError(f"config.json: partial_rotary_factor must be in (0, 1]; got {factor}")
    return {"partial_rotary_factor": factor, "attention_bias": False}


def rows(name: str, start: int, stop: int, total: int, width: int):
    """A reader of rows [start, stop) of the fused tensor `name` [total, width] (under the layer's
    prefix), as the [in, out] leaf the model multiplies by (its cut: the weights API's names)."""
    def read(get, prefix: str) -> np.ndarray:
        w = np.asarray(get(prefix + name))
        if w.ndim != 2 or w.shape[0] != total:
            raise ValueError(f"tensor {prefix + name!r} has shape {w.shape}; expected {total} rows (fused)")
        return w[start:stop].T
    return with_cuts(read, lambda prefix: (Cut(prefix + name, (total, width), start=start, stop=stop,
                                                 transpose=True),))


def layer_tensors(cfg: ModelConfig) -> dict:
    nq, nkv, inter, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, \
        cfg.hidden_size
    qkv = nq + 2 * nkv
    fused = {"wq": rows(QKV, 0, nq, qkv, h), "wk": rows(QKV, nq, nq + nkv, qkv, h),
             "wv": rows(QKV, nq + nkv, qkv, qkv, h),
             "w_gate": rows(GATE_UP, 0, inter, 2 * inter, h), "w_up": rows(GATE_UP, inter, 2 * inter, 2 * inter, h)}
    return {**ATTENTION_TENSORS, **MLP_TENSORS, **fused}


FAMILY = registry.ModelFamily(config_fields=config_fields, param_shapes=_param_shapes, layer_tensors=layer_tensors,
                              ffn=dense_mlp, partition_rules=dense_partition_rules)
