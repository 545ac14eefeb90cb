"""Multi-head latent attention (DeepSeek V2/V3) over the latent paged pool, with absorbed weights.

Per token (H heads, R = kv_lora_rank, nope / rope / v: qk_nope_head_dim / qk_rope_head_dim / v_head_dim):

    q        x -> [wq_a -> RMSNorm -> wq_b | wq] -> [H, nope + rope]: q_nope, q_pe
    latent   x -> wkv_a -> [R + rope]: c = RMSNorm(first R), k_pe = the rest (one rotary key for all heads)
    rope     on q_pe and k_pe only: interleaved pairs (V2; V3 with rope_interleave) or rotate-half,
             YaRN's attention factor on cos and sin (models/rope.py)
    pool     c | k_pe: one entry of R + rope values per token and layer (models/kv_layout.py)

transformers expands the latent into per-head keys k_nope = W_UK c and values v = W_UV c (kv_b_proj).
Here the weights are absorbed instead, so the pool is read as it is, for decode and prefill alike:

    q_nope . (W_UK c) = (W_UK^T q_nope) . c         q_abs = [W_UK^T q_nope | q_pe]   [H, R + rope]
    scores = softmax_scale * q_abs . [c | k_pe]      one MQA head over the pool's R + rope wide keys
    out_h  = W_UV (sum_j p_j c_j)                    the same pool's first R values as the values
    y      = wo [out_1 .. out_H]

The attention is the XLA path's ragged paged attention (pallas_kernels reference_core: cached
context and this step's tokens, ragged, chunked prefill and prefix-cache hits alike) with the pool
given as both K and V; its value columns past R (P . k_pe) are dropped, 64 of 576 (11%) more work in
the value product than a kernel that skips them. On the Pallas backends (GPUs) a decode-only step
runs the MLA decode kernel instead (pallas_kernels/mla_decode.py, FlashMLA's design: one read of each
latent block for all the heads of a sequence, split-K); prefill and mixed steps keep the XLA path.
A short prefill takes the same absorbed form; a long one the expanded form (models/mla_prefill.py:
fewer flops per score, nope + rope and v against R + rope twice, at the price of up-projecting the
context's K and V, chunk by chunk; the rule and its CPU measurement are there). scripts/bench_mla.py
measures the decode step of both, scripts/bench_mla_prefill.py the prefill.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jaxserve.models.attention import PALLAS_BACKENDS, PALLAS_INTERPRET, AttentionMetadata, decode_rows
from jaxserve.models.config import ModelConfig, MlaConfig
from jaxserve.models import mla_prefill
from jaxserve.models.llama import rms_norm
from jaxserve.models.rope import apply_rope, attention_scale, inv_frequencies
from jaxserve.quantization.matmul import matmul
from pallas_kernels.common import to_storage
from pallas_kernels.mla_decode import mla_decode

# transformers' q_a_layernorm and kv_a_layernorm are DeepseekV*RMSNorm(rank): their default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def mla(cfg: ModelConfig) -> MlaConfig:
    if cfg.mla is None:
        raise ValueError(f"{cfg.architecture}: config has no latent attention (kv_lora_rank)")
    return cfg.mla


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[qk_rope_head_dim // 2] inverse frequencies: the config's RoPE (YaRN included) over the rotary dims."""
    return inv_frequencies(replace(cfg, head_dim=mla(cfg).qk_rope_head_dim, partial_rotary_factor=1.0))


def rotate(cfg: ModelConfig, x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [T, n, rope] rotated. Interleaved pairs (x0, x1), (x2, x3), ... come out as [evens | odds]
    rotated (transformers' apply_rotary_pos_emb_interleave; V2's complex form is a permutation of it):
    q_pe and k_pe are permuted alike, so their dot products are the checkpoint's."""
    if mla(cfg).rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, positions, inv_freq, attention_scale(cfg))


def project(cfg: ModelConfig, lp: dict, x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
            dots: jnp.dtype | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, hidden] normed -> q_nope [T, H, nope], q_pe [T, H, rope] rotated, and each token's pool
    entry [T, R + rope]: its normed latent, then its rotated key."""
    m, t = mla(cfg), x.shape[0]
    if "wq_a" in lp:
        q = matmul(rms_norm(matmul(x, lp["wq_a"], dots), lp["q_a_norm"], LATENT_NORM_EPS), lp["wq_b"], dots)
    else:
        q = matmul(x, lp["wq"], dots)
    q = q.reshape(t, cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
    q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    kv = matmul(x, lp["wkv_a"], dots)  # [T, R + rope]
    latent = rms_norm(kv[:, :m.kv_lora_rank], lp["kv_a_norm"], LATENT_NORM_EPS)
    k_pe = rotate(cfg, kv[:, None, m.kv_lora_rank:], positions, inv_freq)[:, 0]
    return q_nope, rotate(cfg, q_pe, positions, inv_freq), jnp.concatenate([latent, k_pe], axis=-1)


def write_entries(pool: jax.Array, entries: jax.Array, slot_mapping: jax.Array, layer: jax.Array) -> jax.Array:
    """pool [L, 1, blocks, block_size, R + rope] with layer `layer`'s rows of this step's tokens set
    (entries [T, R + rope]; a negative slot is padding, dropped): one scatter, in place when donated."""
    num_blocks, block_size = pool.shape[2], pool.shape[3]
    slots = slot_mapping.astype(jnp.int32)
    block = jnp.where(slots >= 0, slots // block_size, num_blocks)  # out of range: dropped
    offset = jnp.where(slots >= 0, slots % block_size, 0)
    return pool.at[layer, 0, block, offset].set(to_storage(entries, pool.dtype), mode="drop")


def attention(cfg: ModelConfig, lp: dict, x: jax.Array, positions: jax.Array, pool: jax.Array,
              md: AttentionMetadata, layer: jax.Array, inv_freq: jax.Array,
              dots: jnp.dtype | None = None, backend: str = "xla") -> tuple[jax.Array, jax.Array]:
    """One layer's attention: x [T, hidden] normed -> ([T, hidden], the pool with this step's entries)."""
    m, t = mla(cfg), x.shape[0]
    q_nope, q_pe, entries = project(cfg, lp, x, positions, inv_freq, dots)
    pool = write_entries(pool, entries, md.slot_mapping, layer)

    def absorbed() -> jax.Array:
        q_latent = jnp.einsum("thn,hnr->thr", q_nope, lp["w_uk"].astype(q_nope.dtype))  # W_UK absorbed into q
        q_abs = jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1)  # [T, H, R + rope]
        out = latent_attention(cfg, q_abs, pool, md, layer, backend)  # the latent's weighted sum [T, H, R]
        return jnp.einsum("thr,hvr->thv", out, lp["w_uv"].astype(out.dtype))  # W_UV: [T, H, v]

    # a long prefill may take the expanded form instead (models/mla_prefill.py: K, V up-projected)
    heads = mla_prefill.heads(cfg, lp, q_nope, q_pe, pool, md, layer, absorbed)
    return matmul(heads.reshape(t, cfg.num_heads * m.v_head_dim), lp["wo"], dots), pool


def latent_attention(cfg: ModelConfig, q_abs: jax.Array, pool: jax.Array, md: AttentionMetadata,
                     layer: jax.Array, backend: str) -> jax.Array:
    """q_abs [T, H, R + rope] over the pool -> [T, H, R]. A decode-only step on the Pallas backends runs
    the MLA decode kernel (pallas_kernels/mla_decode.py: each block read once for all heads); any other
    step, and the XLA backend, the ragged XLA path with the pool as both K and V (the values' rotary
    columns dropped after)."""
    m = mla(cfg)
    if backend in PALLAS_BACKENDS and md.decode_only:
        kv_lens, tables = decode_rows(md, q_abs.shape[0])
        return mla_decode(q_abs, pool, kv_lens, tables, kv_lora_rank=m.kv_lora_rank, sm_scale=m.softmax_scale,
                          layer=layer, interpret=backend == PALLAS_INTERPRET)
    return pallas_kernels.ragged_paged_attention_reference(
        q_abs, pool, pool, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
        sm_scale=m.softmax_scale, layer=layer)[..., :m.kv_lora_rank]
