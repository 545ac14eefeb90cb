"""Block tables per request on top of the device BlockPool (and a host swap pool).

The manager knows token positions, not requests' lifecycles: the scheduler
tells it "request r has `num_computed` tokens in cache and will write
`num_new` more" and gets back either the copy-on-write pairs to run before the
step, or None when the pool cannot cover it (the scheduler then preempts).

    positions:   0 ............ num_computed ........ num_computed+num_new
    block table: [ b0 | b1 | b2 | b3 ]               (block_size tokens each)
                         written this step: b1..b3 -> any with ref count > 1
                         is copied first (copy-on-write), missing ones allocated

Pure Python, no JAX.
"""

from __future__ import annotations

from jaxserve.core.block_pool import BlockHash, BlockPool, hash_request_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    num_groups = 1  # block tables per request (HybridKVCacheManager: one per KV group)

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 num_cpu_blocks: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Host blocks are never shared or hashed: a plain pool whose free list is LRU.
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.req_to_blocks: dict[str, list[int]] = {}
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._extra_keys: dict[str, int] = {}  # request id -> its LoRA adapter id, when not the base model
        # Leading blocks of each request already offered to the prefix cache.
        self._num_offered: dict[str, int] = {}
        # Requests holding KV computed with weights since replaced (reset_prefix_cache(weights_changed=True)):
        # their blocks never enter the cache, so no later request reuses KV of the old weights.
        self._stale: set[str] = set()

    # -- queries ------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def cpu_usage(self) -> float:
        return self.cpu_pool.usage if self.cpu_pool is not None else 0.0

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache -------------------------------------------------------
    def set_extra_key(self, request_id: str, extra_key: int) -> None:
        """Key the request's cached blocks by `extra_key` too (its LoRA adapter): the same tokens
        under another adapter have other KV, so they never share blocks."""
        if extra_key:
            self._extra_keys[request_id] = extra_key

    def _hashes(self, request_id: str, token_ids: list[int]) -> list[BlockHash]:
        hashes = hash_request_blocks(token_ids, self.block_size, self._block_hashes.get(request_id),
                                     self._extra_keys.get(request_id, 0))
        self._block_hashes[request_id] = hashes
        return hashes

    def get_computed_blocks(self, request_id: str, token_ids: list[int]) -> list[int]:
        """Longest cached prefix of full blocks, leaving at least one token uncomputed
        (the runner needs the last token's logits). Takes no references."""
        if not self.enable_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._hashes(request_id, token_ids)[:max_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_caching or request_id not in self.req_to_blocks or request_id in self._stale:
            return
        table = self.req_to_blocks[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_offered.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request_id, token_ids[:num_full * self.block_size])
        for i in range(start, num_full):
            self.block_pool.cache_block(table[i], hashes[i])
        self._num_offered[request_id] = num_full

    # -- allocation ---------------------------------------------------------
    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[tuple[int, int]] | None:
        """Make the block table cover positions < num_computed + num_new, copying any
        shared block those new positions fall into. Returns the (src, dst) copies,
        or None (and changes nothing) if the pool is too small right now.

        `computed_blocks` (from get_computed_blocks, only for a request with no
        table yet) become the head of the table, one more reference each.
        """
        pool = self.block_pool
        computed = computed_blocks or []
        table = self.req_to_blocks.get(request_id, [])
        if computed and table:
            raise RuntimeError(f"request {request_id} already has blocks; prefix hits are for admission")
        num_existing = len(table) + len(computed)
        num_needed = self.blocks_needed(num_computed_tokens + num_new_tokens)
        first_written = num_computed_tokens // self.block_size
        cow = [i for i in range(first_written, min(num_needed, len(table)))
               if pool.ref_counts[table[i]] > 1]
        num_fresh = max(0, num_needed - num_existing)
        # A cached block with no owner sits in the free list until we take it.
        num_revived = sum(1 for b in set(computed) if pool.ref_counts[b] == 0)
        if num_fresh + len(cow) + num_revived > pool.num_free_blocks:
            return None
        pool.incref(computed)
        table = computed + table
        copies = []
        for i in cow:
            (dst,) = pool.allocate(1)
            copies.append((table[i], dst))
            pool.free([table[i]])  # still referenced by the sharer(s)
            table[i] = dst
        table.extend(pool.allocate(num_fresh))
        self.req_to_blocks[request_id] = table
        return copies

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[int]:
        """Share the parent's blocks covering its first `num_tokens` positions."""
        if child_id in self.req_to_blocks:
            raise RuntimeError(f"request {child_id} already has blocks")
        shared = self.req_to_blocks[parent_id][:self.blocks_needed(num_tokens)]
        self.block_pool.incref(shared)
        self.req_to_blocks[child_id] = list(shared)
        if parent_id in self._stale:
            self._stale.add(child_id)
        return list(shared)

    def free(self, request_id: str) -> None:
        """Release everything the request holds, device and host."""
        table = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free(table[::-1])
        cpu_table = self.req_to_cpu_blocks.pop(request_id, [])
        if self.cpu_pool is not None:
            self.cpu_pool.free(cpu_table[::-1])
        self._num_offered.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Drop per-request hash memo once the request is gone for good."""
        self.free(request_id)
        self._block_hashes.pop(request_id, None)
        self._extra_keys.pop(request_id, None)
        self._stale.discard(request_id)

    def reset_prefix_cache(self, weights_changed: bool = False) -> None:
        """Forget every cached block (vLLM's reset_prefix_cache). `weights_changed`: the requests that
        hold KV now (on the device or swapped out) never offer their blocks to the cache later either,
        since that KV was computed with the weights just replaced."""
        self.block_pool.reset_prefix_cache()
        if weights_changed:
            self._stale.update(self.req_to_blocks, self.req_to_cpu_blocks)

    # -- swap ---------------------------------------------------------------
    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host blocks: (device, cpu) pairs, or None if
        the host pool is too small (the caller then recomputes instead)."""
        table = self.req_to_blocks.get(request_id, [])
        if self.cpu_pool is None or len(table) > self.cpu_pool.num_free_blocks:
            return None
        cpu_table = self.cpu_pool.allocate(len(table))
        self.free(request_id)
        self.req_to_cpu_blocks[request_id] = cpu_table
        return list(zip(table, cpu_table))

    def swap_in(self, request_id: str, num_computed_tokens: int,
                num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more:
        (cpu, device) pairs, or None (and nothing changes) if the pool is short."""
        cpu_table = self.req_to_cpu_blocks[request_id]
        num_needed = max(len(cpu_table), self.blocks_needed(num_computed_tokens + num_new_tokens))
        if num_needed > self.block_pool.num_free_blocks:
            return None
        table = self.block_pool.allocate(len(cpu_table))
        del self.req_to_cpu_blocks[request_id]
        assert self.cpu_pool is not None
        self.cpu_pool.free(cpu_table[::-1])
        self.req_to_blocks[request_id] = table
        copies = self.allocate_slots(request_id, num_computed_tokens, num_new_tokens)
        assert copies == [], "fresh swapped-in blocks are never shared"
        return list(zip(cpu_table, table))
