"""int8 weights and activations (W8A8) for the decoder's matmuls: `--quantization int8`.

Every matmul weight [..., in, out] becomes int8 with one float32 scale per output
channel (symmetric, absmax / 127). At run time each activation row is quantized
the same way (one scale per token, computed on the fly), the dot runs int8 x int8
with int32 accumulation, and the product is rescaled to float:

    y[t, o] = (sum_i xq[t, i] * wq[i, o]) * x_scale[t] * w_scale[o]

Why both operands: XLA:CPU does not fuse an int8 -> float convert into its dot,
so int8 weights with float activations would be converted in memory every step
(bfloat16 weights that way were 3x slower than float32); an int8 x int8 dot is
native and about 1.6x faster than float32 at 32 and at 512 rows here (see
BENCHMARKS.md). llama.cpp does the same with its Q8 activations.

The quantized layout also fuses projections that share an input: wq|wk|wv
become one `wqkv` and w_gate|w_up one `w_gate_up`, so a layer runs four dots
instead of seven (12% fewer milliseconds at 32 rows). The LM head is quantized
too (for tied embeddings a quantized copy of embed.T; the embedding lookup stays
in float). Norms, biases, the embedding lookup, attention and the KV cache stay
in the model's dtype.

Not exact: the default (no quantization) is the one held to transformers'
outputs; `tests/test_quant.py` bounds how far int8 moves from it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.constants import QUANTIZATIONS
from jaxserve.models.config import ModelConfig


def is_quantized(w: object) -> bool:
    return isinstance(w, dict) and "q" in w and "scale" in w


@jax.jit
def quantize_weight(w: jax.Array) -> dict[str, jax.Array]:
    """[..., in, out] float -> {"q": int8 [..., in, out], "scale": float32 [..., out]}."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2)
    scale = amax / 127.0
    q = jnp.round(wf / jnp.where(amax > 0, scale, 1.0)[..., None, :])
    return {"q": q.astype(jnp.int8), "scale": scale}


def int8_matmul(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """x [..., in] (float) @ a quantized weight [in, out] -> [..., out] in x.dtype."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    xq = jnp.round(xf * (127.0 / jnp.where(amax > 0, amax, 1.0))).astype(jnp.int8)  # |xq| <= 127
    acc = jax.lax.dot_general(xq, w["q"], (((x.ndim - 1,), (0,)), ((), ())),
                              preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * (amax / 127.0) * w["scale"]).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array | dict[str, jax.Array]) -> jax.Array:
    """x @ w for a float weight or a quantized one."""
    return int8_matmul(x, w) if is_quantized(w) else x @ w


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


@functools.partial(jax.jit, static_argnames="cfg")
def activation_absmax(params: dict, cfg: ModelConfig, token_ids: jax.Array) -> dict[str, jax.Array]:
    """Per-channel max |x| of every matmul input over one causal sequence, from a dense float forward.

    Returns {"qkv": [L, hidden], "o": [L, nq*hd], "gate_up": [L, hidden], "down": [L, inter],
    "head": [hidden]}. The attention is dense and causal (no cache, no sliding window: the
    calibration sequence is short).
    """
    from jaxserve.models.llama import project_qkv, rms_norm
    from jaxserve.models.rope import inv_frequencies

    num_tokens = token_ids.shape[0]
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    inv_freq = jnp.asarray(inv_frequencies(cfg), jnp.float32)
    causal = positions[:, None] >= positions[None, :]
    amax = lambda x: jnp.max(jnp.abs(x.astype(jnp.float32)), axis=0)  # noqa: E731

    def layer(h, lp):
        x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = project_qkv(cfg, lp, x, positions, inv_freq)
        q = q.reshape(num_tokens, cfg.num_kv_heads, -1, cfg.head_dim)
        s = jnp.einsum("qhgd,khd->hgqk", q, k) * cfg.head_dim ** -0.5
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        o = jnp.einsum("hgqk,khd->qhgd", p, v).reshape(num_tokens, -1)
        h = h + o @ lp["wo"]
        x2 = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
        m = jax.nn.silu(x2 @ lp["w_gate"]) * (x2 @ lp["w_up"])
        return h + m @ lp["w_down"], {"qkv": amax(x), "o": amax(o), "gate_up": amax(x2), "down": amax(m)}

    h, stats = jax.lax.scan(layer, params["embed"][token_ids], params["layers"])
    return {**stats, "head": amax(rms_norm(h, params["final_norm"], cfg.rms_norm_eps))}


def _smooth(act: jax.Array, w: jax.Array, alpha: float = 0.5) -> jax.Array:
    """SmoothQuant's per-input-channel factor: dividing x by it and multiplying W's rows by it
    evens out activation outliers against weight magnitudes. act [..., in], w [..., in, out]."""
    wmax = jnp.max(jnp.abs(w), axis=-1)
    factor = jnp.power(jnp.maximum(act, 1e-5), alpha) / jnp.power(jnp.maximum(wmax, 1e-5), 1 - alpha)
    return jnp.clip(factor, 1e-2, 1e2)


def smooth_params(params: dict, cfg: ModelConfig, token_ids: np.ndarray, alpha: float = 0.5) -> dict:
    """The float params with activation outliers moved into the weights (SmoothQuant), still float.

    Per-channel activation maxima are measured on `token_ids` (see `calibration_ids`), and
    each matmul input x is divided by s = max|x|^alpha / max|W row|^(1 - alpha) while W's rows
    are multiplied by s. Every 1/s is folded into a float parameter the input already passes
    through, so the model computes the same function and the run time pays nothing: the norms
    for qkv, gate/up and the LM head; wv's columns for wo (one factor per kv-head channel,
    which every query head of its group reads); w_up's columns for w_down. The result has the
    quantized layout (fused `wqkv` and `w_gate_up`, an explicit `lm_head`) in float32.
    """
    act = activation_absmax(params, cfg, jnp.asarray(token_ids, jnp.int32))
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


QUANTIZED_LEAVES = ("wqkv", "w_gate_up", "wo", "w_down")


def quantize_params(params: dict, cfg: ModelConfig, method: str, token_ids: np.ndarray) -> dict:
    """The float params (llama.param_shapes' tree), smoothed (`smooth_params`) on `token_ids`,
    with every matmul weight quantized by `method` and the rest back in the model's dtype."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {method!r}")
    dtype = params["embed"].dtype
    smooth = smooth_params(params, cfg, token_ids)
    layers = {k: quantize_weight(v) if k in QUANTIZED_LEAVES else v.astype(dtype)
              for k, v in smooth["layers"].items()}
    return {**smooth, "layers": layers, "final_norm": smooth["final_norm"].astype(dtype),
            "lm_head": quantize_weight(smooth["lm_head"])}
