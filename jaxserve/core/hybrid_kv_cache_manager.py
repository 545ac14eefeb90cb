"""Sliding-window layers hold only their window in the KV pool (vLLM's hybrid allocator).

Design (the manager side; pure Python, no JAX):
1. kv_groups() splits the layers into groups of k = gcd(#full, #sliding) layers of one kind; Gemma 3
   (5 sliding : 1 full, 18 layers) gives 1 full + 5 sliding groups of 3 layers. Layer i reads pool slot
   `slot` (its index in its group) through its group's block table.
2. The pool becomes [k, kv_heads, num_blocks, block_size, head_dim]: a block id is a page for k layers of
   whichever group holds it; every group draws from the one BlockPool free list (and LRU prefix cache).
3. A request holds one block table per group. A full group's grows as before. A sliding group (window
   W: a query at q reads keys > q - W) gives back each block wholly before num_computed - W + 1 - LAG
   and marks the slot NULL_BLOCK; get_block_tables() sends block 0 there, which the kernels never read
   (they start at the window's first block) or mask. num_computed only grows (drafts count once accepted).
4. LAG (2 tokens): an n > 1 child recomputes its parent's last prompt token, and the parent may be a step
   ahead (async scheduling), so a fork still finds its window.
5. Copy-on-write, fork, swap and recompute preemption act per group; NULL slots are never referenced,
   copied or swapped. allocate_slots is all-or-nothing over the groups (only dead blocks go back on None).
6. Prefix caching: group g caches a block under the request's chain hash mixed with g. A hit of h blocks
   needs every full group's h blocks and each sliding group's blocks inside the window before h*block_size.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jaxserve.core.block_pool import BlockHash
from jaxserve.core.kv_cache_manager import KVCacheManager

NULL_BLOCK = -1  # a sliding group's slot outside its window: owns nothing
LAG = 2  # tokens a sliding group keeps beyond its window (point 4 above)


class KVGroup(NamedTuple):
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # model layer indices; layers[j] reads pool slot j


def kv_groups(num_layers: int, sliding_layers: tuple[int, ...] | None, window: int | None) -> list[KVGroup]:
    """Full groups first, then sliding ones, each of gcd(#full, #sliding) layers (one group of every layer
    when the model has one kind only)."""
    sliding = sorted(set(sliding_layers)) if sliding_layers is not None and window else []
    if any(i >= num_layers for i in sliding):
        raise ValueError(f"sliding_layers must be < num_layers={num_layers}; got {sliding_layers}")
    if window is not None and window <= 0:
        raise ValueError(f"sliding_window must be > 0, got {window}")
    full = [i for i in range(num_layers) if i not in set(sliding)]
    if not sliding or not full:
        return [KVGroup(window if sliding else None, tuple(range(num_layers)))]
    k = math.gcd(len(full), len(sliding))
    return ([KVGroup(None, tuple(full[j:j + k])) for j in range(0, len(full), k)]
            + [KVGroup(window, tuple(sliding[j:j + k])) for j in range(0, len(sliding), k)])


def layer_slots(num_layers: int, sliding_layers: tuple[int, ...] | None,
                window: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(group, slot) of every layer under kv_groups: the block table it reads and its index in the
    pool's k-layer axis (the runner's layer scan takes both as data, models/gemma.py)."""
    group, slot = [0] * num_layers, [0] * num_layers
    for g, kv_group in enumerate(kv_groups(num_layers, sliding_layers, window)):
        for s, layer in enumerate(kv_group.layers):
            group[layer], slot[layer] = g, s
    return tuple(group), tuple(slot)


class GroupedHits(list):
    """get_computed_blocks' answer: as a list, the first group's hit blocks (len() * block_size is the
    number of cached tokens, as the scheduler reads it); `.tables`, every group's table (NULL outside)."""

    def __init__(self, tables: list[list[int]]) -> None:
        super().__init__(tables[0] if tables else [])
        self.tables = tables


class HybridKVCacheManager(KVCacheManager):
    """KVCacheManager's interface with one block table per KV group (req_to_blocks[r] is a list of tables)."""

    def __init__(self, groups: list[KVGroup], num_blocks: int, block_size: int, enable_caching: bool = False,
                 num_cpu_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, enable_caching, num_cpu_blocks)
        if not groups or len({len(g.layers) for g in groups}) != 1:
            raise ValueError("KV groups must be non-empty and of one size (kv_groups)")
        self.groups = groups
        self.req_to_blocks: dict[str, list[list[int]]] = {}  # type: ignore[assignment]
        self.req_to_cpu_blocks: dict[str, list[list[int]]] = {}  # type: ignore[assignment]

    # -- queries ------------------------------------------------------------
    @property
    def num_groups(self) -> int:  # type: ignore[override]
        return len(self.groups)

    def first_needed(self, group: KVGroup, num_computed_tokens: int) -> int:
        """Index of the first block the group's next query (at num_computed_tokens) may read."""
        if group.window is None:
            return 0
        return max(0, num_computed_tokens - group.window + 1 - LAG) // self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        tables = self.req_to_blocks.get(request_id)
        return self.get_block_tables(request_id)[0] if tables else []

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """Every group's table as the runner sends it: NULL slots read as block 0 (never attended)."""
        return [[max(b, 0) for b in t] for t in self.req_to_blocks.get(request_id, [])]

    def num_held_blocks(self, request_id: str) -> int:
        return sum(b != NULL_BLOCK for t in self.req_to_blocks.get(request_id, []) for b in t)

    # -- prefix cache -------------------------------------------------------
    @staticmethod
    def _group_hash(g: int, h: BlockHash) -> BlockHash:
        return BlockHash(hash((g, h.hash_value)), h.token_ids)

    def _cached(self, g: int, hashes: list[BlockHash], i: int) -> int | None:
        return self.block_pool.get_cached_block(self._group_hash(g, hashes[i]))

    def get_computed_blocks(self, request_id: str, token_ids: list[int]) -> GroupedHits:  # type: ignore[override]
        """Longest h (full blocks, one token left uncomputed) every group can serve: full groups their
        whole prefix, sliding ones the window before h * block_size (the rest NULL). Takes no references."""
        if not self.enable_caching:
            return GroupedHits([])
        hashes = self._hashes(request_id, token_ids)[:(len(token_ids) - 1) // self.block_size]
        h = len(hashes)
        for g, group in enumerate(self.groups):  # full groups bound h by their contiguous prefix
            if group.window is None:
                h = next((i for i in range(h) if self._cached(g, hashes, i) is None), h)
        sliding = [g for g, group in enumerate(self.groups) if group.window is not None]
        for n in range(h, 0, -1):  # sliding groups: only their window is looked up (O(h * window))
            if all(self._cached(g, hashes, i) is not None
                   for g in sliding for i in range(self.first_needed(self.groups[g], n * self.block_size), n)):
                return GroupedHits([[NULL_BLOCK] * (first := self.first_needed(group, n * self.block_size))
                                    + [self._cached(g, hashes, i) for i in range(first, n)]  # type: ignore[misc]
                                    for g, group in enumerate(self.groups)])
        return GroupedHits([])

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        if not self.enable_caching or request_id not in self.req_to_blocks or request_id in self._stale:
            return
        tables = self.req_to_blocks[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(tables[0]))
        start = self._num_offered.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request_id, token_ids[:num_full * self.block_size])
        for g, table in enumerate(tables):
            for i in range(start, min(num_full, len(table))):
                if table[i] != NULL_BLOCK:
                    self.block_pool.cache_block(table[i], self._group_hash(g, hashes[i]))
        self._num_offered[request_id] = num_full

    # -- allocation ---------------------------------------------------------
    def _drop_outside_window(self, tables: list[list[int]], num_computed_tokens: int) -> None:
        """Give back each sliding group's blocks the next query can no longer read (dead KV)."""
        for group, table in zip(self.groups, tables):
            first = min(self.first_needed(group, num_computed_tokens), len(table))
            dead = [b for b in table[:first] if b != NULL_BLOCK]
            table[:first] = [NULL_BLOCK] * first
            self.block_pool.free(dead[::-1])

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,  # type: ignore[override]
                       computed_blocks: list[int] | None = None) -> list[tuple[int, int]] | None:
        """KVCacheManager.allocate_slots over every group; `computed_blocks`: get_computed_blocks' answer."""
        pool, have = self.block_pool, request_id in self.req_to_blocks
        hit_tables = getattr(computed_blocks, "tables", None) or [[] for _ in self.groups]
        if computed_blocks and have:
            raise RuntimeError(f"request {request_id} already has blocks; prefix hits are for admission")
        tables = self.req_to_blocks[request_id] if have else [[] for _ in self.groups]
        self._drop_outside_window(tables, num_computed_tokens)
        num_needed = self.blocks_needed(num_computed_tokens + num_new_tokens)
        first_written = num_computed_tokens // self.block_size
        cows = [[i for i in range(first_written, min(num_needed, len(t)))
                 if t[i] != NULL_BLOCK and pool.ref_counts[t[i]] > 1] for t in tables]
        fresh = [max(0, num_needed - len(t) - len(h)) for t, h in zip(tables, hit_tables)]
        hits = {b for h in hit_tables for b in h if b != NULL_BLOCK}
        num_revived = sum(1 for b in hits if pool.ref_counts[b] == 0)
        if sum(fresh) + sum(map(len, cows)) + num_revived > pool.num_free_blocks:
            return None
        pool.incref([b for h in hit_tables for b in h if b != NULL_BLOCK])  # all before any allocate() evicts
        copies = []
        for g, table in enumerate(tables):
            table[:0] = hit_tables[g]
            for i in cows[g]:
                (dst,) = pool.allocate(1)
                copies.append((table[i], dst))
                pool.free([table[i]])  # still referenced by the sharer(s)
                table[i] = dst
            table.extend(pool.allocate(fresh[g]))
        self.req_to_blocks[request_id] = tables
        return copies

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[list[int]]:  # type: ignore[override]
        """Share the parent's blocks covering its first `num_tokens` positions, in every group; the child
        recomputes position num_tokens - 1, so its window from there must still be held."""
        if child_id in self.req_to_blocks:
            raise RuntimeError(f"request {child_id} already has blocks")
        n = self.blocks_needed(num_tokens)
        shared = [list(t[:n]) for t in self.req_to_blocks[parent_id]]
        for group, table in zip(self.groups, shared):  # the child's first query, at num_tokens - 1, reads
            first = 0 if group.window is None else max(0, num_tokens - group.window) // self.block_size
            if NULL_BLOCK in table[first:]:
                raise RuntimeError(f"request {parent_id} gave back blocks inside the window of a fork at "
                                   f"{num_tokens - 1} tokens")
        for table in shared:
            self.block_pool.incref([b for b in table if b != NULL_BLOCK])
        self.req_to_blocks[child_id] = shared
        if parent_id in self._stale:
            self._stale.add(child_id)
        return [list(t) for t in shared]

    def free(self, request_id: str) -> None:
        for table in self.req_to_blocks.pop(request_id, []):
            self.block_pool.free([b for b in table[::-1] if b != NULL_BLOCK])
        for table in self.req_to_cpu_blocks.pop(request_id, []):
            assert self.cpu_pool is not None
            self.cpu_pool.free([b for b in table[::-1] if b != NULL_BLOCK])
        self._num_offered.pop(request_id, None)

    # -- swap ---------------------------------------------------------------
    def _move(self, tables: list[list[int]], dst_pool) -> tuple[list[list[int]], list[tuple[int, int]]]:  # noqa: ANN001
        """Fresh blocks of dst_pool for every held slot (NULL stays NULL): the new tables and (src, dst)."""
        new, pairs = [], []
        for table in tables:
            moved = [dst_pool.allocate(1)[0] if b != NULL_BLOCK else NULL_BLOCK for b in table]
            pairs += [(s, d) for s, d in zip(table, moved) if s != NULL_BLOCK]
            new.append(moved)
        return new, pairs

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        tables = self.req_to_blocks.get(request_id, [])
        if self.cpu_pool is None or self.num_held_blocks(request_id) > self.cpu_pool.num_free_blocks:
            return None
        cpu_tables, pairs = self._move(tables, self.cpu_pool)
        self.free(request_id)
        self.req_to_cpu_blocks[request_id] = cpu_tables
        return pairs

    def swap_in(self, request_id: str, num_computed_tokens: int,
                num_new_tokens: int) -> list[tuple[int, int]] | None:
        cpu_tables = self.req_to_cpu_blocks[request_id]
        num_needed = self.blocks_needed(num_computed_tokens + num_new_tokens)
        held = sum(b != NULL_BLOCK for t in cpu_tables for b in t)
        growth = sum(max(0, num_needed - len(t)) for t in cpu_tables)  # an upper bound: the window only frees
        if held + growth > self.block_pool.num_free_blocks:
            return None
        tables, pairs = self._move(cpu_tables, self.block_pool)
        del self.req_to_cpu_blocks[request_id]
        assert self.cpu_pool is not None
        for table in cpu_tables:
            self.cpu_pool.free([b for b in table[::-1] if b != NULL_BLOCK])
        self.req_to_blocks[request_id] = tables
        copies = self.allocate_slots(request_id, num_computed_tokens, num_new_tokens)
        assert copies == [], "fresh swapped-in blocks are never shared"
        return pairs
