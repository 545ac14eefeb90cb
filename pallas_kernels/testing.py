"""Test helpers: random paged batches and an independent float64 numpy oracle.

Used by tests/test_pallas_*.py and scripts/gpu_check.py; no JAX code path here
shares anything with the references or kernels it checks.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PagedBatch:
    q: np.ndarray  # [T_padded, Hq, D]
    k_cache: np.ndarray  # [Hkv, NB, BS, D]
    v_cache: np.ndarray  # [Hkv, NB, BS, D]
    kv_lens: np.ndarray  # i32[max_num_seqs]
    block_tables: np.ndarray  # i32[max_num_seqs, MB]
    cu_q_lens: np.ndarray  # i32[max_num_seqs + 1]
    num_seqs: int
    owned: np.ndarray  # bool[NB, BS]: slots holding some sequence's live context


def make_batch(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per real sequence
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_num_seqs: int | None = None,
    pad_tokens: int = 0,
    extra_blocks: int = 3,
    dtype=np.float32,
) -> PagedBatch:
    num_seqs = len(seqs)
    max_num_seqs = max_num_seqs or num_seqs
    need = [-(-kv // block_size) for _, kv in seqs]
    max_blocks = max(max(need, default=1), 1) + 1
    num_blocks = sum(need) + extra_blocks
    perm = rng.permutation(num_blocks)
    # Garbage everywhere first: unused table entries point at other requests' blocks.
    tables = rng.integers(0, num_blocks, (max_num_seqs, max_blocks)).astype(np.int32)
    owned = np.zeros((num_blocks, block_size), bool)
    used = 0
    for s, (_, kv) in enumerate(seqs):
        ids = perm[used : used + need[s]]
        used += need[s]
        tables[s, : need[s]] = ids
        for p in range(kv):
            owned[ids[p // block_size], p % block_size] = True
    q_lens = [ql for ql, _ in seqs]
    cu = np.zeros(max_num_seqs + 1, np.int32)
    cu[1 : num_seqs + 1] = np.cumsum(q_lens)
    cu[num_seqs + 1 :] = cu[num_seqs]
    kv_lens = rng.integers(0, 50, max_num_seqs).astype(np.int32)  # garbage past num_seqs
    kv_lens[:num_seqs] = [kv for _, kv in seqs]
    num_tokens = int(cu[num_seqs]) + pad_tokens
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return PagedBatch(
        q=rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(dtype),
        k_cache=rng.standard_normal(shape).astype(dtype),
        v_cache=rng.standard_normal(shape).astype(dtype),
        kv_lens=kv_lens,
        block_tables=tables,
        cu_q_lens=cu,
        num_seqs=num_seqs,
        owned=owned,
    )


def poison(cache: np.ndarray, owned: np.ndarray, value: float) -> np.ndarray:
    """Fills every slot no sequence owns (freed blocks, tails past kv_len) with value."""
    out = cache.copy()
    out[:, ~owned] = value
    return out


def numpy_attention(
    b: PagedBatch,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Float64 ragged paged attention, one query at a time; padding tokens are 0.

    sinks [Hq]: transformers' GptOss eager attention: the sink is a last column of the
    logits, the softmax runs over all columns, and the sink's column is dropped."""
    num_tokens, num_q_heads, head_dim = b.q.shape
    num_kv_heads, _, block_size, _ = b.k_cache.shape
    group = num_q_heads // num_kv_heads
    out = np.zeros((num_tokens, num_q_heads, head_dim))
    q = b.q.astype(np.float64)
    for s in range(b.num_seqs):
        start, end = int(b.cu_q_lens[s]), int(b.cu_q_lens[s + 1])
        kv_len = int(b.kv_lens[s])
        pos = np.arange(kv_len)
        blocks = b.block_tables[s, pos // block_size]
        k = b.k_cache[:, blocks, pos % block_size].astype(np.float64)  # [Hkv, kv, D]
        v = b.v_cache[:, blocks, pos % block_size].astype(np.float64)
        for i in range(end - start):
            q_pos = kv_len - (end - start) + i
            ok = pos <= q_pos
            if sliding_window is not None:
                ok &= pos > q_pos - sliding_window
            for h in range(num_q_heads):
                logits = k[h // group] @ q[start + i, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                logits = np.where(ok, logits, -np.inf)
                if sinks is not None:
                    logits = np.concatenate([logits, [float(sinks[h])]])
                if not np.isfinite(logits).any():
                    continue
                w = np.exp(logits - logits.max())
                w = w / w.sum()
                out[start + i, h] = w[:kv_len] @ v[h // group]
    return out
