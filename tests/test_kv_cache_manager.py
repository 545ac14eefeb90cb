"""KVCacheManager under random allocate / fork / write / free / prefix-hit / swap sequences.

A shadow "device" holds, per block slot, the token written there. After every
step each request must read its own tokens back through its block table, and
every block registered in the prefix cache must hold exactly its hashed tokens:
that catches a missed copy-on-write, a wrong prefix hit or a bad swap, not just
bad reference counts.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.core.kv_cache_manager import KVCacheManager
from tests.kv_machine_rules import FreeAndSwapRules

NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS = 12, 4, 8


class KVCacheMachine(FreeAndSwapRules, RuleBasedStateMachine):  # free/swap rules: tests/kv_machine_rules.py
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True,
                                 num_cpu_blocks=NUM_CPU_BLOCKS)
        self.dev: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.cpu: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_CPU_BLOCKS)]
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.swapped: set[str] = set()
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------
    def _on_device(self) -> list[str]:
        return sorted(r for r in self.tokens if r not in self.swapped)

    def _write(self, rid: str, num_computed: int, num_new: int,
               hits: list[int] | None = None) -> bool:
        copies = self.kv.allocate_slots(rid, num_computed, num_new, hits)
        if copies is None:
            return False
        for src, dst in copies:
            self.dev[dst] = list(self.dev[src])
        table = self.kv.get_block_ids(rid)
        for p in range(num_computed, num_computed + num_new):
            self.dev[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = self.tokens[rid][p]
        self.computed[rid] = num_computed + num_new
        self.kv.cache_blocks(rid, self.tokens[rid], self.computed[rid])
        return True

    # -- rules ------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=24), data=st.data())
    def add(self, tokens: list[int], data: st.DataObject) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.tokens[rid] = tokens
        hits = self.kv.get_computed_blocks(rid, tokens)
        assert len(hits) * BLOCK_SIZE < len(tokens), "at least one token left to compute"
        num_computed = len(hits) * BLOCK_SIZE
        num_new = data.draw(st.integers(1, len(tokens) - num_computed))
        if not self._write(rid, num_computed, num_new, hits):
            del self.tokens[rid]
            self.kv.forget(rid)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data(), more=st.lists(st.integers(0, 1), max_size=6))
    def extend(self, data: st.DataObject, more: list[int]) -> None:
        rid = data.draw(st.sampled_from(self._on_device()))
        self.tokens[rid] += more
        gap = len(self.tokens[rid]) - self.computed[rid]
        if gap > 0:
            self._write(rid, self.computed[rid], data.draw(st.integers(1, gap)))

    @precondition(lambda self: any(self.computed[r] > 0 for r in self._on_device()))
    @rule(data=st.data(), diverge=st.integers(0, 1))
    def fork(self, data: st.DataObject, diverge: int) -> None:
        parent = data.draw(st.sampled_from([r for r in self._on_device() if self.computed[r] > 0]))
        child = f"r{self.next_id}"
        self.next_id += 1
        n = self.computed[parent]
        self.kv.fork(parent, child, n)
        # Like a parallel sample: recompute the last shared token, then write its own.
        self.tokens[child] = self.tokens[parent][:n] + [diverge]
        self.computed[child] = n - 1
        self._write(child, n - 1, 2)

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def refcounts_match_tables(self) -> None:
        pool = self.kv.block_pool
        owners = [0] * NUM_BLOCKS
        for table in self.kv.req_to_blocks.values():
            for b in table:
                owners[b] += 1
        for b in range(NUM_BLOCKS):
            assert pool.ref_counts[b] == owners[b] >= 0
            assert pool.is_free(b) == (owners[b] == 0), "a block is both free and owned"
        cpu_owned = [b for t in self.kv.req_to_cpu_blocks.values() for b in t]
        assert len(cpu_owned) == len(set(cpu_owned))
        assert self.kv.cpu_pool is not None
        assert self.kv.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS - len(cpu_owned)

    @invariant()
    def requests_read_their_tokens(self) -> None:
        for rid, toks in self.tokens.items():
            store, table = ((self.cpu, self.kv.req_to_cpu_blocks[rid]) if rid in self.swapped
                            else (self.dev, self.kv.get_block_ids(rid)))
            for p in range(self.computed[rid]):
                assert store[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] == toks[p], (rid, p)

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        pool = self.kv.block_pool
        for b, h in enumerate(pool.block_hashes):
            if h is not None:
                assert tuple(self.dev[b]) == h.token_ids
                assert pool.get_cached_block(h) == b

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.kv.forget(rid)
        assert self.kv.num_free_blocks == NUM_BLOCKS, "pool returns to fully free"
        assert self.kv.cpu_pool is not None and self.kv.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS


KVCacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


def test_fork_then_write_copies_shared_block() -> None:
    kv = KVCacheManager(8, 4)
    assert kv.allocate_slots("p", 0, 6) == []
    table = kv.get_block_ids("p")
    kv.fork("p", "c", 6)
    # The child recomputes position 5 (in the shared 2nd block): copy first.
    copies = kv.allocate_slots("c", 5, 1)
    assert copies == [(table[1], kv.get_block_ids("c")[1])]
    assert kv.get_block_ids("c")[0] == table[0], "untouched prefix stays shared"
    assert kv.allocate_slots("p", 6, 1) == [], "parent is the sole owner again"
    kv.forget("p")
    kv.forget("c")
    assert kv.num_free_blocks == 8


def test_prefix_hit_leaves_one_token_and_revives_freed_blocks() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    toks = list(range(8))
    kv.allocate_slots("a", 0, 8)
    kv.cache_blocks("a", toks, 8)
    kv.forget("a")
    assert kv.num_free_blocks == 8
    # Same 8 tokens: only the first block may be reused (the 2nd holds the last token).
    assert len(kv.get_computed_blocks("b", toks)) == 1
    hits = kv.get_computed_blocks("c", toks + [99])
    assert len(hits) == 2
    assert kv.allocate_slots("c", 8, 1, hits) == []
    assert kv.get_block_ids("c")[:2] == hits and kv.num_free_blocks == 5


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(2, 4)
    assert kv.allocate_slots("a", 0, 8) == []
    assert kv.allocate_slots("b", 0, 1) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 0


def test_free_releases_tail_blocks_first() -> None:
    # The tail of a sequence is the least shareable: it should be evicted first.
    kv = KVCacheManager(4, 2)
    kv.allocate_slots("a", 0, 6)
    table = kv.get_block_ids("a")
    kv.forget("a")
    assert kv.block_pool.free_block_ids() == [3] + table[::-1]


def test_reset_after_a_weight_update_never_caches_the_old_weights_kv():
    """reset_prefix_cache(weights_changed=True): the cache is empty, and a request that held KV at the
    update (computed with the old weights) never offers its blocks later, nor do its forks; a request
    admitted after the update caches as usual."""
    kv = KVCacheManager(8, BLOCK_SIZE, enable_caching=True)
    tokens = list(range(3 * BLOCK_SIZE))
    assert kv.allocate_slots("old", 0, 2 * BLOCK_SIZE) == []
    kv.cache_blocks("old", tokens, BLOCK_SIZE)  # one block computed, cached
    assert kv.get_computed_blocks("probe", tokens) == kv.get_block_ids("old")[:1]
    kv.reset_prefix_cache(weights_changed=True)
    assert kv.get_computed_blocks("probe2", tokens) == []
    kv.cache_blocks("old", tokens, 2 * BLOCK_SIZE)  # its second block fills after the update
    kv.fork("old", "old#1", 2 * BLOCK_SIZE)
    kv.cache_blocks("old#1", tokens, 2 * BLOCK_SIZE)
    assert kv.get_computed_blocks("probe3", tokens) == []
    assert kv.allocate_slots("new", 0, 2 * BLOCK_SIZE) == []
    kv.cache_blocks("new", tokens, 2 * BLOCK_SIZE)
    assert kv.get_computed_blocks("probe4", tokens) == kv.get_block_ids("new")[:2]
    kv.reset_prefix_cache()  # a plain reset: "new" may offer blocks again
    kv.forget("new")
    assert kv.get_computed_blocks("probe5", tokens) == []
