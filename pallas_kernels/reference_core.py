"""Paged attention in pure jnp: the CPU serving path.

Shared by ``ragged_paged_attention_reference`` and
``paged_attention_decode_reference``. On a CPU the cost of paged attention is
the gather of K/V blocks, not the arithmetic, so the keys a query sees are
split in two and each part is read as little as possible:

    token t of sequence s (this step's new tokens of s are packed contiguously
    and start at position new_start_s):

    positions  [first_key_t ........ new_start_s)  [new_start_s ... q_pos_t]
               part A: cached context               part B: this step's tokens
               a flat list of (query, block) pairs, read once (one row per token,
               2048 keys gathered per iteration:    by its own slot), then banded
               only the blocks each query needs     causal attention in packed
               (a fresh prompt: none); a query is   order, tile against tile
               a decode token, or a group of 32
               new tokens of one sequence sharing
               each gathered block

Both parts run a flash-style online softmax ``(max, sum, acc)`` and are merged
at the end. Part A's pair list keeps a batch's short contexts from paying for
its longest one (a padded [tokens, longest context] gather wasted about 2/3 of
its reads on log-normal contexts) and a mixed step's prompt tokens from paying
for its decode tokens; part B keeps a prompt's tokens from each gathering the
whole prompt again. The new tokens' K/V must already be in the pool
(``write_kv`` runs first), so the signature needs no extra K/V inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import NEG_INF, cap_logits, first_key, to_float32

# Packed query tokens per tile of part B (tile against tile).
_TILE = 32
# Cached keys per part-A loop iteration (as blocks: 2048 // block_size). On a 2-core CPU
# (SmolLM2-135M, 22-32 decode tokens with log-normal contexts) 128 blocks of 16 beat 64, 256
# and 512 of 16, and 32 blocks of 64 beat 16 and 64 of 64.
_PAIR_TOKENS = 2048
# Query tokens of one sequence sharing each gathered block, and cached keys per iteration then
# (16 and 32 blocks of 16 tokens did the same on a 512-token chunk after 512 cached).
_GROUP = 32
_GROUP_PAIR_TOKENS = 2048
# A sequence with at most this many new tokens in a step (a decode token with its speculative
# drafts, a short prompt tail) reads part A token by token, as decode tokens do: a group of 32
# scores 32 query rows per gathered block however few of them are real, which made a step of
# 2 sequences with 4 new tokens each 4x as slow as one of 2 decode tokens.
_SHORT_RUN = 8


def _gather(cache: jax.Array, layer: jax.Array | int | None, ids: tuple[jax.Array, ...],
            heads_first: bool = True) -> jax.Array:
    """cache[(layer,) :, *ids] with the head axis first: [heads, *ids[0].shape, rest]
    (or after the ids' axes with heads_first=False: [*ids[0].shape, heads, rest]).

    ids index the axes after the heads (blocks, then optionally a row in the block). One
    gather, layer included; heads are a whole-slice offset dimension, so with the pool
    sharded on heads each device gathers its own.
    """
    if layer is None:
        cache = cache[None]
    shape, n = ids[0].shape, len(ids)
    start = jnp.stack([jnp.broadcast_to(jnp.asarray(0 if layer is None else layer, jnp.int32), shape),
                       *(i.astype(jnp.int32) for i in ids)], -1)
    rest = cache.shape[2 + n:]
    head_axis = 0 if heads_first else len(shape)
    dims = lax.GatherDimensionNumbers(
        offset_dims=(head_axis, *range(len(shape) + 1, len(shape) + 1 + len(rest))),
        collapsed_slice_dims=(0, *range(2, 2 + n)), start_index_map=(0, *range(2, 2 + n)))
    return lax.gather(cache, start, dims, (1, cache.shape[1], *([1] * n), *rest),
                      mode=lax.GatherScatterMode.CLIP)


def gather_blocks(
    cache: jax.Array, block_ids: jax.Array, layer: jax.Array | int | None
) -> jax.Array:
    """cache[(layer,) :, block_ids] laid out [heads, *block_ids.shape, block_size, dim].

    Heads lead, as in every array of this module but the decode pairs' (_decode_partials,
    which multiply-reduce instead of einsum): each einsum then has its batch axes
    (heads, pairs) in front of both operands and of its result, a plain batched matmul
    for XLA:CPU. With the heads inside [pairs, queries, heads, ...], XLA transposed
    around every dot (a grouped part-A iteration's dots and softmax took twice as long).
    """
    return _gather(cache, layer, (block_ids,))


def _softmax_update(carry, s, mask, v, pv_spec: str):
    """One online-softmax step: s [..., K] scores, mask broadcastable to s, v the values."""
    m, l, acc = carry
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + p.sum(axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum(pv_spec, p, v)
    return m_new, l, acc


def _merge_pairs(carry, rows, m_p, l_p, acc_p, *, rows_sorted: bool = False):
    """Fold partial softmaxes (max, sum, acc) into the running ones at rows of axis 1.

    carry: m, l [H, R, ...], acc [H, R, ..., D]; rows [N]; m_p, l_p [H, N, ...] and
    acc_p [H, N, ..., D], each scaled to its own max m_p. Several partials may share a
    row: scatter max, then scatter add of each partial rescaled to the new max.
    """
    m, l, acc = carry
    m_new = m.at[:, rows].max(m_p, indices_are_sorted=rows_sorted)
    scale = jnp.exp(m - m_new)
    w = jnp.exp(m_p - m_new[:, rows])  # 0 where masked (m_p = NEG_INF) unless nothing seen yet
    l = (l * scale).at[:, rows].add(w * l_p, indices_are_sorted=rows_sorted)
    acc = (acc * scale[..., None]).at[:, rows].add(w[..., None] * acc_p, indices_are_sorted=rows_sorted)
    return m_new, l, acc


def _partials(s, mask, v, pv):
    """A pair's own softmax: s [..., K] scores -> max, sum, and `pv(weights, v)`."""
    s = jnp.where(mask, s, NEG_INF)
    m_p = s.max(-1)
    e = jnp.where(mask, jnp.exp(s - m_p[..., None]), 0.0)
    return m_p, e.sum(-1), pv(e, v)


def _decode_partials(qh, k_cache, v_cache, blk, t, key_ok, mask, *, soft_cap, layer):
    """Part A's pairs of one query each (a decode token and one block of its context):
    each pair's own softmax, heads first as _merge_pairs takes them.

    Pairs lead here, as XLA:CPU's gather produces them: with heads first it copied both
    gathered blocks through a transpose. K is read transposed ([P, Hkv, D, BS], folded
    into the gather's copy), so that q.k and p.v both reduce over a major axis, vectorised
    along a minor one: a multiply-reduce over the minor head_dim axis ran at a third of
    that speed. blk, t [P] (block, token); key_ok, mask [P, BS]. Returns m, l [Hkv, P, G]
    and acc [Hkv, P, G, D].
    """
    k = to_float32(_gather(k_cache, layer, (blk,), heads_first=False)).swapaxes(-1, -2)  # [P, Hkv, D, BS]
    v = to_float32(_gather(v_cache, layer, (blk,), heads_first=False))  # [P, Hkv, BS, D]
    v = jnp.where(key_ok[:, None, :, None], v, 0.0)  # a freed block may hold NaN/inf
    q = qh[:, t].swapaxes(0, 1)  # [P, Hkv, G, D]
    s = (q[..., None] * k[:, :, None]).sum(-2)  # [P, Hkv, G, BS]
    pv = lambda e, v: (e[..., None] * v[:, :, None]).sum(-2)  # noqa: E731
    m_p, l_p, acc_p = _partials(cap_logits(s, soft_cap), mask[:, None, None, :], v, pv)
    return m_p.swapaxes(0, 1), l_p.swapaxes(0, 1), acc_p.swapaxes(0, 1)


def _cached_pairs(qh, k_cache, v_cache, tables, q_pos, lo, new_start, seq_ids, leads, group, pairs, *,
                  soft_cap, layer):
    """Part A as a flat list of (query group, block) pairs, `pairs` blocks per loop iteration.

    A group is `group` consecutive packed tokens of one sequence starting at a token
    of `leads`; they share the sequence's cached context, so each of its blocks is
    gathered once for all of them. Pair p is block b_p of group g_p's cached context,
    listed group by group; the loop walks the list, so the work is the number of
    blocks really needed (no padding of short contexts up to the longest one) in few,
    large iterations. Each iteration scores its blocks, reduces them per block (max,
    sum, weighted values) and folds those into the tokens' running softmax with
    scatter max / add. Tokens outside every group get nothing (max NEG_INF, sum 0).
    qh is [Hkv, T, G, D]; returns m, l [Hkv, T, G] and acc [Hkv, T, G, D].
    """
    num_kv_heads, num_tokens, heads_per_kv, head_dim = qh.shape
    num_blocks, block_size = k_cache.shape[-3], k_cache.shape[-2]
    max_blocks = tables.shape[1]
    # A group's first token has its smallest first key (a window only moves forward).
    first = lo // block_size  # [T] first block of the cached part
    end = jnp.where(leads, (new_start + block_size - 1) // block_size, 0)  # one past its last
    count = jnp.maximum(end - first, 0)
    ends = jnp.cumsum(count)  # pair p belongs to the group whose [ends - count, ends) holds p
    total = ends[-1]
    pairs = min(pairs, num_tokens * max_blocks)
    trip = (total + pairs - 1) // pairs
    in_block = jnp.arange(block_size, dtype=jnp.int32)
    offsets = jnp.arange(group, dtype=jnp.int32)

    def body(j, carry):
        p = j * pairs + jnp.arange(pairs, dtype=jnp.int32)
        live = p < total
        t = jnp.minimum(jnp.searchsorted(ends, p, side="right"), num_tokens - 1).astype(jnp.int32)
        b = first[t] + p - (ends[t] - count[t])  # block index in the group's table
        blk = jnp.clip(jnp.take_along_axis(tables[t], jnp.clip(b, 0, max_blocks - 1)[:, None], 1)[:, 0],
                       0, num_blocks - 1)
        rows = jnp.minimum(t[:, None] + offsets, num_tokens - 1)  # [P, Qg] the group's tokens
        in_group = (t[:, None] + offsets < num_tokens) & (seq_ids[rows] == seq_ids[t][:, None])
        key_pos = b[:, None] * block_size + in_block  # [P, BS]
        key_ok = live[:, None] & (key_pos < new_start[t][:, None])  # [P, BS]
        mask = (key_ok[:, None, :] & in_group[:, :, None] & (q_pos[rows] >= 0)[:, :, None]
                & (key_pos[:, None, :] >= lo[rows][:, :, None]))  # [P, Qg, BS]
        if group == 1:
            return _merge_pairs(carry, t, *_decode_partials(qh, k_cache, v_cache, blk, t, key_ok, mask[:, 0],
                                                            soft_cap=soft_cap, layer=layer), rows_sorted=True)
        k = to_float32(gather_blocks(k_cache, blk, layer))  # [Hkv, P, BS, D]
        v = to_float32(gather_blocks(v_cache, blk, layer))
        v = jnp.where(key_ok[None, :, :, None], v, 0.0)  # a freed block may hold NaN/inf
        q = qh[:, rows]  # [Hkv, P, Qg, G, D]
        s = jnp.einsum("hpqgd,hpkd->hpqgk", q, k)  # [Hkv, P, Qg, G, BS]
        pv = functools.partial(jnp.einsum, "hpqgk,hpkd->hpqgd")
        m_p, l_p, acc_p = _partials(cap_logits(s, soft_cap), mask[None, :, :, None, :], v, pv)
        flat = lambda x: x.reshape(num_kv_heads, -1, *x.shape[3:])  # noqa: E731
        return _merge_pairs(carry, rows.reshape(-1), flat(m_p), flat(l_p), flat(acc_p))

    init = (jnp.full((num_kv_heads, num_tokens, heads_per_kv), NEG_INF, jnp.float32),
            jnp.zeros((num_kv_heads, num_tokens, heads_per_kv), jnp.float32),
            jnp.zeros((num_kv_heads, num_tokens, heads_per_kv, head_dim), jnp.float32))
    return lax.fori_loop(0, trip, body, init)


def _new_part(qh, k_new, v_new, q_pos, lo, seq_ids, earliest, tile, *, soft_cap):
    """Part B: each token against this step's tokens of its sequence, tile against tile.

    qh [Hkv, T, G, D]; k_new, v_new [Hkv, T, D] (T a multiple of tile); earliest[t] is
    the packed index of the first key token t sees here. Returns m, l [Hkv, T, G] and
    acc [Hkv, T, G, D].

    Every tile first meets itself (the diagonal: all a decode-only step needs). The
    tile pairs below the diagonal that some query needs, tile i against tiles
    earliest_i .. i-1, then run as a flat pair list, one tile count of pairs per loop
    iteration: a 512-token prompt costs its 120 lower pairs, not the 240 of all
    diagonals below the main one.
    """
    num_kv_heads, num_tokens, group, head_dim = qh.shape
    num_tiles = num_tokens // tile
    valid = q_pos >= 0
    k_tiles, v_tiles = (x.reshape(num_kv_heads, num_tiles, tile, head_dim) for x in (k_new, v_new))
    pos_tiles, seq_tiles, lo_tiles = (x.reshape(num_tiles, tile) for x in (q_pos, seq_ids, lo))
    q_tiles = qh.reshape(num_kv_heads, num_tiles, tile, group, head_dim)
    pv = functools.partial(jnp.einsum, "hiqgk,hikd->hiqgd")

    def scores(qi, ki):  # tile pairs (qi[p], ki[p]); None: all tiles in order (the diagonal)
        at = lambda x, i: x if i is None else x[i]  # noqa: E731
        at_h = lambda x, i: x if i is None else x[:, i]  # noqa: E731
        kpos, qp = at(pos_tiles, ki)[:, None, :], at(pos_tiles, qi)[:, :, None]
        mask = ((at(seq_tiles, ki)[:, None, :] == at(seq_tiles, qi)[:, :, None]) & (kpos <= qp)
                & (kpos >= at(lo_tiles, qi)[:, :, None]) & (kpos >= 0) & (qp >= 0))  # [P, Qt, Kt]
        v = jnp.where((at(pos_tiles, ki) >= 0)[None, :, :, None], at_h(v_tiles, ki), 0.0)
        s = cap_logits(jnp.einsum("hiqgd,hikd->hiqgk", at_h(q_tiles, qi), at_h(k_tiles, ki)), soft_cap)
        return s, mask[None, :, :, None, :], v  # s [Hkv, P, Qt, G, Kt], v [Hkv, P, Kt, D]

    init = (jnp.full((num_kv_heads, num_tiles, tile, group), NEG_INF, jnp.float32),
            jnp.zeros((num_kv_heads, num_tiles, tile, group), jnp.float32),
            jnp.zeros((num_kv_heads, num_tiles, tile, group, head_dim), jnp.float32))
    s, mask, v = scores(None, None)
    carry = _softmax_update(init, s, mask, v, "hiqgk,hikd->hiqgd")

    diag = jnp.arange(num_tiles, dtype=jnp.int32)
    first = jnp.where(valid, earliest // tile, num_tokens).reshape(num_tiles, tile).min(1)
    count = jnp.maximum(diag - first, 0)  # tiles below the diagonal that tile i needs
    ends = jnp.cumsum(count)  # pair p belongs to the tile whose [ends - count, ends) holds p
    total = ends[-1]

    def body(j, carry):
        p = j * num_tiles + diag
        qi = jnp.minimum(jnp.searchsorted(ends, p, side="right"), num_tiles - 1).astype(jnp.int32)
        ki = jnp.clip(first[qi] + p - (ends[qi] - count[qi]), 0, num_tiles - 1)
        s, mask, v = scores(qi, ki)
        mask = mask & (p < total)[None, :, None, None, None]
        return _merge_pairs(carry, qi, *_partials(s, mask, v, pv))

    m, l, acc = lax.fori_loop(0, (total + num_tiles - 1) // num_tiles, body, carry)
    flat = lambda x: x.reshape(num_kv_heads, num_tokens, *x.shape[3:])  # noqa: E731
    return flat(m), flat(l), flat(acc)


def _own_only(qh, k_new, v_new, valid, *, soft_cap):
    """Part B when every token is the only new one of its sequence: each sees itself alone,
    a softmax over one key. Same layout as `_new_part`'s result."""
    s = cap_logits((qh * k_new[:, :, None, :]).sum(-1), soft_cap)  # [Hkv, T, G]
    m = jnp.where(valid[None, :, None], s, NEG_INF)
    l = jnp.broadcast_to(jnp.where(valid, 1.0, 0.0)[None, :, None], m.shape)
    acc = jnp.where(valid[None, :, None, None], v_new[:, :, None, :], 0.0)
    return m, l, jnp.broadcast_to(acc, qh.shape)


def fold_sinks(m: jax.Array, l: jax.Array, acc: jax.Array, sinks: jax.Array):
    """Adds one more logit per row, with a zero value, to a finished online softmax (m, l [...],
    acc [..., D]; sinks broadcastable to m): gpt-oss's attention sinks, which transformers
    concatenates to the scores as a last column and drops after the softmax. The sink enters
    the max too, so exp never overflows; a row that saw nothing gets out = 0 (all weight on
    the sink)."""
    m_new = jnp.maximum(m, sinks)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + jnp.exp(sinks - m_new), acc * alpha[..., None]


def attend_reference(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    v_cache: jax.Array,  # [(L,) Hkv, NB, BS, D]
    token_tables: jax.Array,  # i32[T, MB]: each token's sequence's block table
    q_pos: jax.Array,  # i32[T]: absolute position, -1 for padding tokens
    seq_ids: jax.Array,  # i32[T]: equal within a sequence, distinct across sequences
    new_start: jax.Array,  # i32[T]: position of the first of this step's tokens of the sequence
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    layer: jax.Array | int | None,
    sinks: jax.Array | None = None,  # f32[Hq]: attention sinks (gpt-oss), or None
) -> jax.Array:  # [T, Hq, D] in q.dtype; padding tokens get zeros
    """Causal attention of each token over its sequence's paged context.

    A sequence's tokens of this step must be packed contiguously at consecutive
    positions ending at q_pos, starting at new_start, and already written to the
    pool; keys before new_start are read from the pool only. With sinks, head h's
    softmax denominator gains exp(sinks[h]) (a logit with no value: see fold_sinks).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape[-4:]
    group = num_q_heads // num_kv_heads
    max_blocks = token_tables.shape[1]
    if num_tokens == 0:
        return jnp.zeros_like(q)
    tile = min(_TILE, num_tokens)
    padded = -(-num_tokens // tile) * tile
    extra = padded - num_tokens

    def pad(x, fill):
        return jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1), constant_values=fill) if extra else x

    q_pos = pad(q_pos.astype(jnp.int32), -1)
    valid = q_pos >= 0
    seq_ids = pad(seq_ids.astype(jnp.int32), -1)
    new_start = jnp.where(valid, jnp.minimum(pad(new_start.astype(jnp.int32), 0), q_pos), 0)
    tables = pad(token_tables.astype(jnp.int32), 0)
    lo = first_key(q_pos, sliding_window)
    qh = (pad(q.astype(jnp.float32), 0.0).reshape(padded, num_kv_heads, group, head_dim) * sm_scale
          ).transpose(1, 0, 2, 3)  # [Hkv, T, G, D]: heads lead (see gather_blocks)

    # Part B's keys: each token's own K/V row, read back from the pool by its slot.
    own = jnp.maximum(q_pos, 0)
    own_block = jnp.take_along_axis(tables, jnp.minimum(own // block_size, max_blocks - 1)[:, None], 1)[:, 0]
    own_block = jnp.clip(own_block, 0, k_cache.shape[-3] - 1)
    k_new = to_float32(_gather(k_cache, layer, (own_block, own % block_size)))  # [Hkv, T, D]
    v_new = to_float32(_gather(v_cache, layer, (own_block, own % block_size)))
    idx = jnp.arange(padded, dtype=jnp.int32)
    earliest = idx - (q_pos - jnp.maximum(lo, new_start))
    same_prev = jnp.concatenate([jnp.zeros(1, bool), seq_ids[1:] == seq_ids[:-1]])
    same_next = jnp.concatenate([seq_ids[:-1] == seq_ids[1:], jnp.zeros(1, bool)])
    multi = valid & (same_prev | same_next)  # tokens sharing this step with others of their sequence
    run_start = idx - (q_pos - new_start)  # packed index of the sequence's first new token
    beyond = jnp.minimum(run_start + _SHORT_RUN, padded - 1)
    long_run = multi & (run_start + _SHORT_RUN < padded) & (seq_ids[beyond] == seq_ids)
    # A decode-only step (no such token) needs of part B each token against itself alone: the
    # tiles' diagonal cost it a quarter of its attention on a CPU.
    m_b, l_b, acc_b = lax.cond(
        jnp.any(multi),
        lambda: _new_part(qh, k_new, v_new, q_pos, lo, seq_ids, earliest, tile, soft_cap=soft_cap),
        lambda: _own_only(qh, k_new, v_new, valid, soft_cap=soft_cap))

    # Part A: a decode token (the only new token of its sequence), or one of a short run
    # (_SHORT_RUN), gathers its own blocks; the new tokens of a longer run (a prompt chunk after
    # cached context, a prefix-cache hit) share each gathered block in groups of _GROUP.
    kw = dict(soft_cap=soft_cap, layer=layer)
    single = _cached_pairs(qh, k_cache, v_cache, tables, q_pos, lo, new_start, seq_ids,
                           valid & ~long_run, 1, max(1, _PAIR_TOKENS // block_size), **kw)
    leads = long_run & ((q_pos - new_start) % _GROUP == 0)
    grouped = _cached_pairs(qh, k_cache, v_cache, tables, q_pos, lo, new_start, seq_ids,
                            leads, _GROUP, max(1, _GROUP_PAIR_TOKENS // block_size), **kw)
    m_a, l_a, acc_a = (jnp.where(long_run.reshape(1, -1, *([1] * (x.ndim - 2))), y, x)
                       for x, y in zip(single, grouped))

    m = jnp.maximum(m_a, m_b)
    alpha_a, alpha_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
    l = l_a * alpha_a + l_b * alpha_b
    acc = acc_a * alpha_a[..., None] + acc_b * alpha_b[..., None]
    if sinks is not None:
        m, l, acc = fold_sinks(m, l, acc, sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.transpose(1, 0, 2, 3).reshape(padded, num_q_heads, head_dim)[:num_tokens].astype(q.dtype)

