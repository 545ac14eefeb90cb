"""Perplexity of the default model (SmolLM2-135M-Instruct) under each quantization method, next to float32.

The text is tests/data/quant_eval.txt: prose, code and math segments (split at `=== name ===`
lines), each scored as its own sequence (teacher-forced, one prefill through llama.forward).
Methods:
  float32              the weights as loaded (the GGUF's Q4_1 dequantized: the project's default model)
  int8 (SmoothQuant)   --quantization int8 (W8A8, calibrated through llama.forward)
  fp8 (on load, qwix)  --quantization fp8 on a float checkpoint (e4m3 per channel, per-token activations)
  ct W4A16 g64         compressed-tensors' own quantizer and pack-quantized compressor, read back by our loader
  ct W8A8 int8         compressed-tensors' int-quantized, read back by our loader
  ct FP8_DYNAMIC       compressed-tensors' float-quantized, read back by our loader
  gptq W4 g64 (RTN)    round-to-nearest packed in AutoGPTQ's layout (no GPTQ error correction: a lower bound)
  awq W4 g64 (RTN)     round-to-nearest asymmetric packed in AutoAWQ's layout (no activation-aware scaling)
  kv fp8 (e4m3)        float32 weights over an fp8 KV pool
  bf16 dots            float32 weights, every projection a bfloat16 x bfloat16 dot accumulated in
                       float32: the CPU's `--dtype auto` in steps of 64+ tokens (here every token),
                       and the LM head's (its sampler's, every step)
Group size 64 because SmolLM2's hidden size (576) is not a multiple of 128.
Needs torch and compressed-tensors (the `test` extra). CPU, about a minute per method on 2 cores.

  python scripts/quant_accuracy.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.models import llama  # noqa: E402
from jaxserve.models.attention import AttentionMetadata, make_kv_cache  # noqa: E402
from jaxserve.quantization.formats import detect  # noqa: E402
from jaxserve.quantization.hf_linear import linear_reader  # noqa: E402
from jaxserve.quantization.qweight import QuantizedWeight, stack  # noqa: E402
from jaxserve.quantization.quantize import LINEAR_LEAVES, calibration_ids, quantize_params  # noqa: E402
from jaxserve.weights.loader import load_model  # noqa: E402
from tests import quant_fixtures as qf  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "quant_eval.txt"
GROUP = 64


def segments() -> dict[str, str]:
    out, name, lines = {}, "prose", []
    for line in TEXT.read_text().splitlines():
        if line.startswith("=== ") and line.endswith(" ==="):
            out[name], name, lines = "\n".join(lines), line[4:-4], []
        else:
            lines.append(line)
    out[name] = "\n".join(lines)
    return out


def nll(params, cfg, ids: np.ndarray, kv_dtype, bf16_dots_from: int = 0) -> float:
    """Mean next-token negative log-likelihood of one sequence."""
    t, bs = len(ids), 16
    nb = -(-t // bs)
    md = AttentionMetadata(jnp.arange(t, dtype=jnp.int32), jnp.asarray([t], jnp.int32),
                           jnp.arange(nb, dtype=jnp.int32)[None], jnp.asarray([0, t], jnp.int32),
                           jnp.asarray([1], jnp.int32))
    kv = make_kv_cache(cfg.num_layers, cfg.num_kv_heads, nb, bs, cfg.head_dim, kv_dtype)
    _, hidden = llama.forward(params, cfg, kv, jnp.asarray(ids, jnp.int32), jnp.arange(t, dtype=jnp.int32), md,
                              bf16_dots_from=bf16_dots_from)
    if bf16_dots_from:  # the LM head as the CPU's sampler takes it then: bfloat16 dots, float32 sums
        logits = llama.slice_logits(params, hidden, jnp.int32(0), params["embed"].shape[0], jnp.bfloat16)
    else:
        logits = llama.compute_logits(params, hidden)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return float(-jnp.mean(logp[jnp.arange(t - 1), jnp.asarray(ids[1:])]))


def _numpy(v) -> np.ndarray:
    """A torch tensor (fp8 included) or numpy array as numpy, dtype kept."""
    import torch

    if not torch.is_tensor(v):
        return np.asarray(v)
    if v.dtype == torch.float8_e4m3fn:
        return v.view(torch.uint8).numpy().view(jnp.float8_e4m3fn)
    return v.numpy()


def from_format(params, cfg, qconfig: dict, maker) -> dict:
    """Every linear weight through a checkpoint format's tensors and our loader's reader."""
    spec = detect({"quantization_config": qconfig}, None)
    rng = np.random.default_rng(0)
    layers = dict(params["layers"])
    for leaf in LINEAR_LEAVES:
        w = np.asarray(params["layers"][leaf], np.float32)  # [L, K, N]
        per_layer = []
        for i in range(cfg.num_layers):
            tensors = {f"x.{k}": _numpy(v) for k, v in maker(np.ascontiguousarray(w[i].T), rng)[0].items()}
            per_layer.append(linear_reader(spec, tensors.__getitem__, jnp.float32)("x", w.shape[1:]))
        layers[leaf] = jax.tree.map(jnp.asarray, stack(per_layer))
    return {**params, "layers": layers}


def methods(loaded):
    p, cfg = loaded.params, loaded.config
    yield "float32", p, jnp.float32
    yield "int8 (SmoothQuant W8A8)", quantize_params(p, cfg, "int8", calibration_ids(loaded.tokenizer,
                                                                                     cfg.vocab_size)), jnp.float32
    yield "fp8 (on load, qwix)", quantize_params(p, cfg, "fp8"), jnp.float32
    yield "ct W4A16 g64", from_format(p, cfg, qf.ct_config("W4A16", GROUP),
                                      lambda w, r: qf.ct_linear(w, "W4A16", GROUP)), jnp.float32
    yield "ct W8A8 int8", from_format(p, cfg, qf.ct_config("W8A8"), lambda w, r: qf.ct_linear(w, "W8A8")), jnp.float32
    yield "ct FP8_DYNAMIC", from_format(p, cfg, qf.ct_config("FP8_DYNAMIC"),
                                        lambda w, r: qf.ct_linear(w, "FP8_DYNAMIC")), jnp.float32
    yield "gptq W4 g64 (RTN)", from_format(p, cfg, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                                    "desc_act": False, "sym": True},
                                           lambda w, r: qf.gptq_linear(w, 4, GROUP, True, False, r)), jnp.float32
    yield "awq W4 g64 (RTN)", from_format(p, cfg, {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                                   "version": "gemm"},
                                          lambda w, r: qf.awq_linear(w, GROUP, r)), jnp.float32
    yield "kv fp8 (e4m3)", p, jnp.float8_e4m3fn
    yield "bf16 dots", p, jnp.float32


def linear_ratio(params) -> float:
    """Bytes of the linear weights as stored, over their bfloat16 bytes."""
    ws = [params["layers"][k] for k in params["layers"] if k in LINEAR_LEAVES + ("wqkv", "w_gate_up")]
    stored = sum(w.nbytes for w in ws)
    bf16 = sum(2 * int(np.prod(w.shape)) for w in ws)
    return stored / bf16


def main() -> int:
    t0 = time.perf_counter()
    loaded = load_model(None, dtype="float32", progress=False)
    tok = loaded.tokenizer
    segs = {name: np.asarray(tok(text)["input_ids"], np.int32) for name, text in segments().items()}
    print(f"text: {TEXT.name}, " + ", ".join(f"{k} {len(v)} tokens" for k, v in segs.items()))
    base = None
    for name, params, kv_dtype in methods(loaded):
        dots_from = 1 if name == "bf16 dots" else 0
        ppl = {k: float(np.exp(nll(params, loaded.config, ids, kv_dtype, dots_from))) for k, ids in segs.items()}
        base = base or ppl
        quantized = any(isinstance(w, QuantizedWeight) for w in params["layers"].values())
        ratio = f"{linear_ratio(params):.2f}x" if quantized else "-"
        print(f"{name:26s} " + "  ".join(f"{k} {v:7.3f} ({100 * (v / base[k] - 1):+5.1f}%)" for k, v in ppl.items())
              + f"  linear bytes vs bf16: {ratio}")
    print(f"SUMMARY perplexity per segment, % vs float32 (total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
