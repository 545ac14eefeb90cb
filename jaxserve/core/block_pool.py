"""Reference-counted KV blocks with an LRU free list and a prefix-cache index.

The device KV arrays are allocated once; this pool only hands out their block
ids. A block is free iff its reference count is 0. Free blocks sit in one
ordered free list, least recently freed first:

    free list:  [b7 b2 b9 ... b4]      allocate() pops from the left,
                 ^ evicted first        free() appends on the right

With prefix caching, a full block is also registered under a `BlockHash`
(a hash chain over its parent's hash and its own token ids). Freeing it does
not forget the hash: a later request with the same prefix can take it back out
of the free list (`incref`) until `allocate()` reuses it, which is the LRU
eviction. Pure Python, no JAX.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Identity of a full block's contents, including everything before it.

    `hash_value` chains the parent block's hash; keeping `token_ids` too makes
    a dict lookup exact for the block's own tokens, so a false hit needs a
    64-bit collision of the parent chain *and* identical tokens.
    """

    hash_value: int
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: tuple[int, ...], extra_key: int = 0) -> BlockHash:
    """extra_key: what besides the tokens decides the KV (a LoRA adapter's id; 0: the base model),
    mixed into the first block's hash and so into the whole chain."""
    parent_value = parent.hash_value if parent is not None else (hash(("lora", extra_key)) if extra_key else 0)
    return BlockHash(hash((parent_value, token_ids)), token_ids)


def hash_request_blocks(token_ids: list[int], block_size: int,
                        start: list[BlockHash] | None = None, extra_key: int = 0) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending `start` (already hashed)."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra_key))
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    # -- counting ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out now (cached-but-free blocks included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def free_block_ids(self) -> list[int]:
        """LRU order, next to be evicted first (for tests and debugging)."""
        return list(self._free)

    # -- allocation ---------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise RuntimeError(f"asked for {num} blocks, {len(self._free)} free")
        ids = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            ids.append(block_id)
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks (fork, prefix-cache hit); a free cached block leaves the free list."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each. Callers pass a request's blocks tail first,
        so its last (least shareable) blocks are evicted before its prefix."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed with ref count {self.ref_counts[block_id]}")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    # -- prefix cache -----------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, computed block; no-op (False) if the contents are already
        cached in another block or this block already has a hash."""
        if (not self.enable_caching or self.block_hashes[block_id] is not None
                or block_hash in self._cached):
            return False
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            self.block_hashes[block_id] = None
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._cached.values()):
            self._evict(block_id)
