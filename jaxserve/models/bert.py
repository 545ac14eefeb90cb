"""The BERT family (BERT, RoBERTa, XLM-RoBERTa) as pure functions: encoders for pooling models.

An encoder step sees whole prompts only: a padded batch token_ids [B, S] with each row's length,
bidirectional attention inside a row, and no KV cache (nothing outlives the step). The layers'
weights are stacked on a leading axis and `lax.scan`ned, as in llama.py.

Params (weights stored [in, out]):
    word_embed [vocab, H]   pos_embed [max_pos, H]   type_embed [num_types, H]   embed_ln_w, embed_ln_b [H]
    layers/   every leaf stacked on a leading [L] axis:
      wq, wk, wv, wo [L, H, H]  bq, bk, bv, bo [L, H]  attn_ln_w, attn_ln_b [L, H]
      w_in [L, H, I]  b_in [L, I]  w_out [L, I, H]  b_out [L, H]  mlp_ln_w, mlp_ln_b [L, H]
    head/     (*ForSequenceClassification only)
      BERT:    pooler_w [H, H] pooler_b [H]  classifier_w [H, num_labels] classifier_b [num_labels]
      RoBERTa: dense_w [H, H] dense_b [H]    classifier_w [H, num_labels] classifier_b [num_labels]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import jax
import jax.numpy as jnp

from jaxserve.models import registry
from jaxserve.quantization.matmul import matmul

Params = dict[str, jax.Array | dict[str, jax.Array]]

# architecture -> (family, task): the task a checkpoint of that class is made for (the registry's view)
ENCODER_ARCHITECTURES: dict[str, tuple[str, str]] = registry.encoder_architectures()
_ACTIVATIONS = {"gelu": lambda x: jax.nn.gelu(x, approximate=False), "gelu_new": jax.nn.gelu,
                "relu": jax.nn.relu, "gelu_pytorch_tanh": jax.nn.gelu}


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str  # a key of ENCODER_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_offset: int = 0  # RoBERTa: positions start at padding_idx + 1
    num_labels: int = 0  # 0: no classification head
    id2label: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.architecture not in ENCODER_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not an encoder; "
                             f"supported: {', '.join(ENCODER_ARCHITECTURES)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")

    @property
    def family(self) -> str:
        return ENCODER_ARCHITECTURES[self.architecture][0]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, hf: Mapping, source: str = "config.json") -> "EncoderConfig":
        archs = list(hf.get("architectures") or [])
        arch = next((a for a in archs if a in ENCODER_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: not an encoder architecture: {archs!r}")
        family, task = ENCODER_ARCHITECTURES[arch]
        labels = hf.get("id2label") or {}
        num_labels = len(labels) if task == "classify" else 0
        try:
            return cls(architecture=arch, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
                       intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
                       num_heads=int(hf["num_attention_heads"]),
                       max_position_embeddings=int(hf["max_position_embeddings"]),
                       type_vocab_size=int(hf.get("type_vocab_size", 2)),
                       layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                       hidden_act=str(hf.get("hidden_act", "gelu")),
                       position_offset=int(hf.get("pad_token_id", 1)) + 1 if family == "roberta" else 0,
                       num_labels=num_labels,
                       id2label=tuple(str(labels[k]) for k in sorted(labels, key=int)) if num_labels else ())
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * w + b


def padding_bias(lengths: jax.Array, seq_len: int, causal: bool) -> jax.Array:
    """lengths [B] i32 -> additive attention bias [B, 1, S, S] f32: 0 where key k is visible to query q."""
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    visible = (pos[None, None, :] < lengths[:, None, None])  # [B, 1, S] keys inside the row
    if causal:
        visible = visible & (pos[None, :, None] >= pos[None, None, :])  # [B, S, S]
    return jnp.where(visible, 0.0, -1e30)[:, None].astype(jnp.float32)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array) -> jax.Array:
    """q [B, S, nq, hd], k, v [B, S, nkv, hd], bias [B, 1, S, S] -> [B, S, nq, hd]."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    probs = jax.nn.softmax(scores + bias, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def encode(params: Params, cfg: EncoderConfig, token_ids: jax.Array, type_ids: jax.Array,
           lengths: jax.Array, dots: jnp.dtype | None = None) -> jax.Array:
    """token_ids, type_ids [B, S] i32 (type: the segment of a pair), lengths [B] i32
    -> last hidden states [B, S, H] (positions past a row's length are junk). dots: the projections'
    operands rounded to that dtype, accumulated in float32 (the CPU's --dtype auto, as llama.run_layers)."""
    batch, seq_len = token_ids.shape
    pos = jnp.arange(seq_len, dtype=jnp.int32) + cfg.position_offset
    h = params["word_embed"][token_ids] + params["pos_embed"][pos][None] + params["type_embed"][type_ids]
    h = layer_norm(h, params["embed_ln_w"], params["embed_ln_b"], cfg.layer_norm_eps)
    bias = padding_bias(lengths, seq_len, causal=False)
    act = _ACTIVATIONS[cfg.hidden_act]
    nh, hd = cfg.num_heads, cfg.head_dim

    def layer_body(h: jax.Array, lp: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        q = (matmul(h, lp["wq"], dots) + lp["bq"]).reshape(batch, seq_len, nh, hd)
        k = (matmul(h, lp["wk"], dots) + lp["bk"]).reshape(batch, seq_len, nh, hd)
        v = (matmul(h, lp["wv"], dots) + lp["bv"]).reshape(batch, seq_len, nh, hd)
        attn = dense_attention(q, k, v, bias).reshape(batch, seq_len, nh * hd)
        h = layer_norm(h + matmul(attn, lp["wo"], dots) + lp["bo"], lp["attn_ln_w"], lp["attn_ln_b"],
                       cfg.layer_norm_eps)
        mlp = matmul(act(matmul(h, lp["w_in"], dots) + lp["b_in"]), lp["w_out"], dots) + lp["b_out"]
        return layer_norm(h + mlp, lp["mlp_ln_w"], lp["mlp_ln_b"], cfg.layer_norm_eps), None

    h, _ = jax.lax.scan(layer_body, h, params["layers"])
    return h


def classify(params: Params, cfg: EncoderConfig, hidden: jax.Array) -> jax.Array:
    """hidden [B, S, H] -> logits [B, num_labels] f32 from the first token, as transformers' heads."""
    head = params["head"]
    first = hidden[:, 0]
    if cfg.family == "bert":
        x = jnp.tanh(first @ head["pooler_w"] + head["pooler_b"])
    else:
        x = jnp.tanh(first @ head["dense_w"] + head["dense_b"])
    return (x @ head["classifier_w"] + head["classifier_b"]).astype(jnp.float32)


# leaf -> (transformers name, transposed?), under the prefix the checkpoint uses ("", "bert.", "roberta.")
EMBED_TENSORS = {"word_embed": "embeddings.word_embeddings.weight", "pos_embed": "embeddings.position_embeddings.weight",
                 "type_embed": "embeddings.token_type_embeddings.weight", "embed_ln_w": "embeddings.LayerNorm.weight",
                 "embed_ln_b": "embeddings.LayerNorm.bias"}
LAYER_TENSORS: dict[str, tuple[str, bool]] = {
    "wq": ("attention.self.query.weight", True), "bq": ("attention.self.query.bias", False),
    "wk": ("attention.self.key.weight", True), "bk": ("attention.self.key.bias", False),
    "wv": ("attention.self.value.weight", True), "bv": ("attention.self.value.bias", False),
    "wo": ("attention.output.dense.weight", True), "bo": ("attention.output.dense.bias", False),
    "attn_ln_w": ("attention.output.LayerNorm.weight", False), "attn_ln_b": ("attention.output.LayerNorm.bias", False),
    "w_in": ("intermediate.dense.weight", True), "b_in": ("intermediate.dense.bias", False),
    "w_out": ("output.dense.weight", True), "b_out": ("output.dense.bias", False),
    "mlp_ln_w": ("output.LayerNorm.weight", False), "mlp_ln_b": ("output.LayerNorm.bias", False),
}
HEAD_TENSORS = {
    "bert": {"pooler_w": ("{p}pooler.dense.weight", True), "pooler_b": ("{p}pooler.dense.bias", False),
             "classifier_w": ("classifier.weight", True), "classifier_b": ("classifier.bias", False)},
    "roberta": {"dense_w": ("classifier.dense.weight", True), "dense_b": ("classifier.dense.bias", False),
                "classifier_w": ("classifier.out_proj.weight", True),
                "classifier_b": ("classifier.out_proj.bias", False)},
}
