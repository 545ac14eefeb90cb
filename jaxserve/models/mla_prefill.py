"""MLA prefill in the expanded form (DeepSeek V2/V3), and the rule choosing it over the absorbed one.

The absorbed form (models/mla.py) scores each query against the pool's R + rope wide latent keys and
sums R wide latent values: (2R + rope) multiply-adds per query, key and head. The expanded form first
up-projects each key's latent to per-head K (W_UK c | k_pe) and V (W_UV c): R x (nope + v) per key and
head, once per step, then scores and sums over nope + rope + v: fewer per pair, so it wins once each
key is read by enough queries, i.e. a long prefill (V2-Lite: 512 x 256 / (1088 - 320), ~170 queries
per key by the flop count; scripts/bench_mla_prefill.py measures it on the CPU).

The expanded path here goes over the step's live sequences, and for each over its context (cached
prefix and this step's tokens, read back from the pool where they were just written) in chunks of
CHUNK_TOKENS positions: gather the chunk's latents, up-project them, score the step's tokens of that
sequence against them (causal), and merge the chunk into a running log-sum-exp (online softmax). So
a long cached prefix needs one chunk's K and V at a time, never [context, H, nope + rope] whole. The
queries of a chunk are all T tokens of the step with the other sequences' masked, which is why the
rule below charges T per key and sends a step of many short runs (decode tokens) the absorbed way.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.models.attention import AttentionMetadata
from jaxserve.models.config import ModelConfig
from pallas_kernels.common import num_seqs_scalar, to_float32, token_positions

# Context positions up-projected at a time (a multiple of the block size is taken): V2-Lite's K and V
# for 256 keys are 256 x 16 x 320 x 4 B = 5 MiB, and the scores of 2k queries against them 32 MiB.
CHUNK_TOKENS = 256
# None: the rule (choose); "absorbed" / "expanded": that path for every step with more than one new
# token of a sequence (tests, scripts/bench_mla_prefill.py). Read when a step's program is traced.
FORCE: str | None = None
# The expanded path's cost per flop against the absorbed path's, as measured on the CPU
# (docs/benchmarks/log.md, "MLA prefill"): the rule takes the expanded path when
# EXPANDED_WEIGHT x its flops < the absorbed path's flops.
EXPANDED_WEIGHT = 0.1
_MASKED = -1e30  # a finite -inf: a chunk with no key for a token leaves its running max alone, no NaN


def heads(cfg: ModelConfig, lp: dict, q_nope: jax.Array, q_pe: jax.Array, pool: jax.Array,
          md: AttentionMetadata, layer: jax.Array, absorbed: Callable[[], jax.Array]) -> jax.Array:
    """Each token's per-head attention output [T, H, v] before W_O: `absorbed()` (models/mla.py's) or
    the expanded path, as FORCE or the rule says. A decode-only step, and a step too small for the
    expanded path to win whatever its context (static: no second branch compiled), take absorbed."""
    if md.decode_only or FORCE == "absorbed":
        return absorbed()
    expand = lambda: expanded(cfg, lp, q_nope, q_pe, pool, md, layer)  # noqa: E731
    if FORCE == "expanded":
        return expand()
    if q_nope.shape[0] < min_expanded_tokens(cfg):
        return absorbed()
    return lax.cond(prefers_expanded(cfg, md, q_nope.shape[0], pool.shape[3]), expand, absorbed)


def min_expanded_tokens(cfg: ModelConfig) -> int:
    """The fewest queries per key for which the expanded form's flops undercut the absorbed form's:
    R (nope + v) up-projection per key against (2R + rope) - (nope + rope + v) saved per query."""
    m = cfg.mla
    saved = (2 * m.kv_lora_rank + m.qk_rope_head_dim) - (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    if saved <= 0:
        return 1 << 62  # the expanded form never does less per pair
    return -(-int(EXPANDED_WEIGHT * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim)) // saved)


def prefers_expanded(cfg: ModelConfig, md: AttentionMetadata, num_tokens: int, block_size: int) -> jax.Array:
    """The rule, on the step's data: the flops per head of either path summed over its sequences.
    Absorbed: q_s x kv_s x (2R + rope). Expanded: each chunk's keys up-projected, R (nope + v), and
    scored and summed against all T tokens (the other sequences' masked), (nope + rope + v)."""
    m = cfg.mla
    n = num_seqs_scalar(md.num_seqs)
    live = jnp.arange(md.kv_lens.shape[0]) < n
    kv = jnp.where(live, md.kv_lens, 0).astype(jnp.float32)
    q = jnp.where(live, md.cu_q_lens[1:] - md.cu_q_lens[:-1], 0).astype(jnp.float32)
    chunk = chunk_tokens(block_size)
    kv_chunks = jnp.ceil(kv / chunk) * chunk
    absorbed = jnp.sum(q * kv) * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    per_key = m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) + num_tokens * (
        m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return EXPANDED_WEIGHT * jnp.sum(kv_chunks) * per_key < absorbed


def chunk_tokens(block_size: int) -> int:
    return max(1, CHUNK_TOKENS // block_size) * block_size


def expanded(cfg: ModelConfig, lp: dict, q_nope: jax.Array, q_pe: jax.Array, pool: jax.Array,
             md: AttentionMetadata, layer: jax.Array) -> jax.Array:
    """[T, H, v]: standard attention of each token over its sequence's context, K and V up-projected
    from the pool's latents chunk by chunk, merged by log-sum-exp; padding tokens get zeros."""
    m, t = cfg.mla, q_nope.shape[0]
    n = num_seqs_scalar(md.num_seqs)
    seq_ids, q_pos = token_positions(md.cu_q_lens, md.kv_lens, n, t)
    qn = q_nope.astype(jnp.float32) * m.softmax_scale  # [T, H, nope]
    qp = q_pe.astype(jnp.float32) * m.softmax_scale  # [T, H, rope]
    w_uk, w_uv = lp["w_uk"].astype(jnp.float32), lp["w_uv"].astype(jnp.float32)  # [H, nope, R], [H, v, R]
    block_size = pool.shape[3]
    per_chunk = chunk_tokens(block_size) // block_size
    tables = md.block_tables.astype(jnp.int32)
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % per_chunk)))  # whole chunks to slice
    h = q_nope.shape[1]

    def chunk(s: jax.Array, j: jax.Array, carry: tuple) -> tuple:
        run_max, denom, acc = carry
        blocks = jnp.clip(lax.dynamic_slice(tables[s], (j * per_chunk,), (per_chunk,)), 0, pool.shape[2] - 1)
        entries = to_float32(pool[layer, 0, blocks]).reshape(per_chunk * block_size, -1)  # [C, R + rope]
        latent, k_pe = entries[:, :m.kv_lora_rank], entries[:, m.kv_lora_rank:]
        k_nope = jnp.einsum("cr,hnr->chn", latent, w_uk)  # the chunk's keys and values, per head
        v = jnp.einsum("cr,hvr->chv", latent, w_uv)
        scores = jnp.einsum("thn,chn->thc", qn, k_nope) + jnp.einsum("thr,cr->thc", qp, k_pe)
        k_pos = j * per_chunk * block_size + jnp.arange(per_chunk * block_size, dtype=jnp.int32)
        ok = (seq_ids == s)[:, None] & (q_pos >= 0)[:, None] & (k_pos[None, :] <= q_pos[:, None])
        scores = jnp.where(ok[:, None, :], scores, _MASKED)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=-1))  # [T, H]
        p = jnp.where(ok[:, None, :], jnp.exp(scores - new_max[..., None]), 0.0)
        alpha = jnp.exp(run_max - new_max)
        return new_max, denom * alpha + jnp.sum(p, -1), acc * alpha[..., None] + jnp.einsum("thc,chv->thv", p, v)

    def sequence(s: jax.Array, carry: tuple) -> tuple:
        chunks = (md.kv_lens[s] + per_chunk * block_size - 1) // (per_chunk * block_size)
        return lax.fori_loop(0, chunks, lambda j, c: chunk(s, j, c), carry)

    init = (jnp.full((t, h), _MASKED, jnp.float32), jnp.zeros((t, h), jnp.float32),
            jnp.zeros((t, h, m.v_head_dim), jnp.float32))
    _, denom, acc = lax.fori_loop(0, n, sequence, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(q_nope.dtype)
