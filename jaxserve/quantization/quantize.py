"""Quantize-on-load: `--quantization int8` (SmoothQuant W8A8) and `--quantization fp8` on a float checkpoint.

int8: every matmul weight [..., in, out] becomes int8 with one float32 scale per
output channel, after SmoothQuant moves activation outliers into the weights (the
statistics come from `llama.forward` itself, see calibrate.py). Projections that
share an input are fused (wq|wk|wv -> `wqkv`, w_gate|w_up -> `w_gate_up`: four dots a
layer instead of seven, 12% fewer milliseconds at 32 rows on the CPU) and the LM head
is quantized too; int8 runs on one device.

fp8 (vLLM's `--quantization fp8` on a bf16/fp16 checkpoint): each matmul weight in
float8_e4m3fn with one scale per output channel, activations quantized per token at
run time (dynamic). The projections stay unfused (they shard like the float ones
under tensor parallelism) and the LM head stays in the model's dtype, as vLLM's.

The weight quantization itself is qwix's (`qwix.quantize`, Google's JAX quantization
library): absmax per output channel over each layer, the same arithmetic vLLM uses.
qwix's model-level API (interception of a flax module's dots) is not used: the model
here is a pure function of a dict, and its one matmul entry already dispatches on the
weight's type, so the QArray it returns is re-wrapped as a `QuantizedWeight`.

Not exact: the default (no quantization) is the one held to transformers' outputs;
tests/test_quantization.py bounds how far each method moves from it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from jaxserve.models.config import ModelConfig
from jaxserve.quantization.calibrate import activation_absmax
from jaxserve.quantization.formats import ON_LOAD_METHODS
from jaxserve.quantization.qweight import QuantizedWeight

__all__ = ["ON_LOAD_METHODS", "calibration_ids", "quantize_params"]
LINEAR_LEAVES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
FUSED_LEAVES = ("wqkv", "w_gate_up", "wo", "w_down")

# Calibration text for the activation statistics: prose, a list, code and a chat turn.
CALIBRATION_TEXT = (
    "The history of the city begins with a small fishing village on the northern bank of the river. "
    "Over three centuries it grew into a trading port, and its merchants built the stone bridge that "
    "still carries traffic today.\n\nIngredients: 2 cups of flour, 1 teaspoon of salt, 3 eggs, 250 ml "
    "of milk.\n1. Mix the flour and the salt.\n2. Whisk in the eggs, then the milk, until smooth.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "User: What is the capital of France, and why is it famous?\nAssistant: Paris is the capital of "
    "France. It is famous for the Eiffel Tower, the Louvre museum, its cafes and its long history as a "
    "centre of art, fashion and science. SELECT name, COUNT(*) FROM orders GROUP BY name; 3.14159 x 42 = "
    "131.95 -- 1999-12-31T23:59:59Z #include <stdio.h> printf(\"%d\\n\", x); Das ist gut. C'est la vie."
)


def calibration_ids(tokenizer, vocab_size: int) -> np.ndarray:
    """Token ids of CALIBRATION_TEXT (with the tokenizer's BOS), or fixed spread-out ids without one."""
    if tokenizer is not None:
        ids = np.asarray(tokenizer(CALIBRATION_TEXT)["input_ids"], np.int32)
        if len(ids) >= 16:
            return ids
    return (np.arange(256, dtype=np.int64) * 7919 % vocab_size).astype(np.int32)


def quantize_weight(w: jax.Array, scheme: str = "int8") -> QuantizedWeight:
    """[..., in, out] float -> per-output-channel int8 or float8_e4m3fn (qwix), scales f32 [..., 1, out]."""
    qtype = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[scheme]
    axes = tuple(range(w.ndim - 2)) + (w.ndim - 1,)  # all but the input axis
    q = qwix.quantize(w.astype(jnp.float32), qtype, channelwise_axes=axes)
    return QuantizedWeight(q.qvalue, q.scale.astype(jnp.float32), scheme=scheme)


def _smooth(act: jax.Array, w: jax.Array, alpha: float = 0.5) -> jax.Array:
    """SmoothQuant's per-input-channel factor: dividing x by it and multiplying W's rows by it
    evens out activation outliers against weight magnitudes. act [..., in], w [..., in, out]."""
    wmax = jnp.max(jnp.abs(w), axis=-1)
    factor = jnp.power(jnp.maximum(act, 1e-5), alpha) / jnp.power(jnp.maximum(wmax, 1e-5), 1 - alpha)
    return jnp.clip(factor, 1e-2, 1e2)


def smooth_params(params: dict, cfg: ModelConfig, token_ids: np.ndarray, alpha: float = 0.5) -> dict:
    """The float params with activation outliers moved into the weights (SmoothQuant), still float.

    Each matmul input x is divided by s = max|x|^alpha / max|W row|^(1 - alpha) while W's rows
    are multiplied by s. Every 1/s is folded into a float parameter the input already passes
    through, so the model computes the same function and the run time pays nothing: the norms
    for qkv, gate/up and the LM head; wv's columns for wo (one factor per kv-head channel,
    which every query head of its group reads); w_up's columns for w_down. The result has the
    fused layout (`wqkv`, `w_gate_up`, an explicit `lm_head`) in float32.
    """
    act = activation_absmax(params, cfg, token_ids)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    lay = {k: f32(v) for k, v in params["layers"].items()}
    num_layers, nkv, group = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads

    # wo's input channel (head h, dim d) is a mix of v's channel (kv head of h, d).
    wo = lay["wo"].reshape(num_layers, nkv, group, cfg.head_dim, -1)
    s = _smooth(act["o"].reshape(num_layers, nkv, group, cfg.head_dim).max(2), jnp.abs(wo).max(2), alpha)
    lay["wo"] = (wo * s[:, :, None, :, None]).reshape(lay["wo"].shape)
    sv = s.reshape(num_layers, -1)  # [L, nkv * hd], wv's column order
    lay["wv"] = lay["wv"] / sv[:, None, :]
    if "bv" in lay:
        lay["bv"] = lay["bv"] / sv

    s = _smooth(act["down"], lay["w_down"], alpha)
    lay["w_up"], lay["w_down"] = lay["w_up"] / s[:, None, :], lay["w_down"] * s[..., None]

    for fused, parts, norm, stat in (("wqkv", ("wq", "wk", "wv"), "attn_norm", "qkv"),
                                     ("w_gate_up", ("w_gate", "w_up"), "mlp_norm", "gate_up")):
        w = jnp.concatenate([lay.pop(p) for p in parts], axis=-1)
        s = _smooth(act[stat], w, alpha)
        lay[norm], lay[fused] = lay[norm] / s, w * s[..., None]

    head = f32(params["lm_head"] if "lm_head" in params else params["embed"].T)
    s = _smooth(act["head"], head, alpha)
    return {**params, "layers": lay, "final_norm": f32(params["final_norm"]) / s, "lm_head": head * s[:, None]}


def quantize_params(params: dict, cfg: ModelConfig, method: str, token_ids: np.ndarray | None = None) -> dict:
    """The float params (llama.param_shapes' tree) with every matmul weight quantized by `method`
    (int8: smoothed on `token_ids` first, see `calibration_ids`) and the rest in the model's dtype."""
    if method not in ON_LOAD_METHODS:
        raise ValueError(f"quantization: {method!r} cannot be applied to a float checkpoint; "
                         f"supported: {', '.join(ON_LOAD_METHODS)}")
    if cfg.moe is not None and method == "int8":
        raise ValueError(f"quantization: int8 (SmoothQuant) does not cover the experts of {cfg.architecture}; "
                         "use fp8 (attention and dense projections in e4m3, experts in the model dtype)")
    if method == "int8" and "attn_norm" not in params["layers"]:
        raise ValueError(f"quantization: int8 (SmoothQuant) folds its scales into the norm before each projection; "
                         f"{cfg.architecture} norms the sub-layers' outputs instead; use fp8")
    dtype = params["embed"].dtype
    if method == "fp8":
        layers = {k: quantize_weight(v, "fp8") if k in LINEAR_LEAVES else v for k, v in params["layers"].items()}
        return {**params, "layers": layers}
    smooth = smooth_params(params, cfg, token_ids)
    layers = {k: quantize_weight(v) if k in FUSED_LEAVES else v.astype(dtype) for k, v in smooth["layers"].items()}
    return {**smooth, "layers": layers, "final_norm": smooth["final_norm"].astype(dtype),
            "lm_head": quantize_weight(smooth["lm_head"])}
