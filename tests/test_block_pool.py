"""BlockPool: reference counts, the LRU free list, prefix-cache registration and eviction."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.block_pool import BlockPool, hash_block_tokens, hash_request_blocks


def test_no_jax_import() -> None:
    # The host side must stay importable and testable without JAX (plain ints and lists).
    code = ("import sys, jaxserve.core.scheduler, jaxserve.core.kv_cache_manager; "
            "assert 'jax' not in sys.modules, 'scheduler imports jax'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_and_free_in_lru_order() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 1
    pool.free([2, 0])
    # Least recently freed first: 3 was never used, then 2, then 0.
    assert pool.free_block_ids() == [3, 2, 0]
    assert pool.allocate(2) == [3, 2]
    with pytest.raises(RuntimeError):
        pool.allocate(2)


def test_refcounts_and_double_free() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.free([b])
    assert not pool.is_free(b) and pool.ref_counts[b] == 1
    pool.free([b])
    assert pool.is_free(b)
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_cached_block_survives_free_until_evicted() -> None:
    pool = BlockPool(2, enable_caching=True)
    h = hash_block_tokens(None, (1, 2))
    (b,) = pool.allocate(1)
    assert pool.cache_block(b, h)
    assert not pool.cache_block(b, h), "already registered"
    pool.free([b])
    assert pool.get_cached_block(h) == b and pool.num_free_blocks == 2
    pool.incref([b])  # a prefix hit revives it
    assert pool.ref_counts[b] == 1 and pool.num_free_blocks == 1
    pool.free([b])
    other = pool.allocate(2)  # the pool needs every block: b is evicted
    assert b in other and pool.get_cached_block(h) is None and pool.block_hashes[b] is None


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    assert not pool.cache_block(b, hash_block_tokens(None, (1,)))


def test_hash_chain_depends_on_prefix() -> None:
    a = hash_request_blocks([1, 2, 3, 4, 5], 2)
    b = hash_request_blocks([9, 9, 3, 4], 2)
    assert len(a) == 2 and len(b) == 2
    assert a[1].token_ids == b[1].token_ids and a[1] != b[1]
    assert hash_request_blocks([1, 2, 3, 4, 5, 6], 2, start=a) [:2] == a


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "free", "cache"]),
                          st.integers(0, 7), st.integers(1, 3)), max_size=60))
def test_random_ops_keep_pool_consistent(ops: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(8, enable_caching=True)
    owned: list[int] = []  # one entry per reference we hold
    for op, pick, num in ops:
        if op == "alloc" and num <= pool.num_free_blocks:
            owned += pool.allocate(num)
        elif op == "incref" and owned:
            b = owned[pick % len(owned)]
            pool.incref([b])
            owned.append(b)
        elif op == "free" and owned:
            pool.free([owned.pop(pick % len(owned))])
        elif op == "cache" and owned:
            pool.cache_block(owned[pick % len(owned)], hash_block_tokens(None, (pick, num)))
        for b in range(8):
            assert pool.ref_counts[b] == owned.count(b) >= 0
            assert pool.is_free(b) == (pool.ref_counts[b] == 0)
            h = pool.block_hashes[b]
            assert h is None or pool.get_cached_block(h) == b
    pool.free(owned)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
