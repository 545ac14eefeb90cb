"""HybridKVCacheManager (sliding-window groups give back blocks outside their window) under random
allocate / fork / write / free / prefix-hit / swap sequences, in the style of test_kv_cache_manager.

A shadow device holds, per block slot, (group, token) written there. After every step each request must
read its own tokens, written by the same group, through each group's table at every position its next
query reads (the whole context for a full group, the window for a sliding one); every cached block must
hold its hashed tokens; reference counts must equal the tables' non-NULL entries.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.core.hybrid_kv_cache_manager import NULL_BLOCK, HybridKVCacheManager, KVGroup, kv_groups
from tests.kv_machine_rules import FreeAndSwapRules
from jaxserve.core.scheduler import ModelOutput, SampledToken, SchedulerConfig, SchedulerOutput
from tests import scheduler_helpers

NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS, WINDOW = 24, 4, 16, 5
GROUPS = kv_groups(3, (0, 2), WINDOW)  # one full group (layer 1), two sliding ones


class HybridKVMachine(FreeAndSwapRules, RuleBasedStateMachine):  # free/swap rules: tests/kv_machine_rules.py
    def __init__(self) -> None:
        super().__init__()
        self.kv = HybridKVCacheManager(GROUPS, NUM_BLOCKS, BLOCK_SIZE, enable_caching=True,
                                       num_cpu_blocks=NUM_CPU_BLOCKS)
        self.dev: list[list[tuple[int, int] | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.cpu: list[list[tuple[int, int] | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_CPU_BLOCKS)]
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.swapped: set[str] = set()
        self.next_id = 0

    def _on_device(self) -> list[str]:
        return sorted(r for r in self.tokens if r not in self.swapped)

    def _write(self, rid: str, num_computed: int, num_new: int, hits: list[int] | None = None) -> bool:
        copies = self.kv.allocate_slots(rid, num_computed, num_new, hits)
        if copies is None:
            return False
        for src, dst in copies:
            self.dev[dst] = list(self.dev[src])
        for g, table in enumerate(self.kv.req_to_blocks[rid]):
            for p in range(num_computed, num_computed + num_new):
                self.dev[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = (g, self.tokens[rid][p])
        self.computed[rid] = num_computed + num_new
        self.kv.cache_blocks(rid, self.tokens[rid], self.computed[rid])
        return True

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=24), data=st.data())
    def add(self, tokens: list[int], data: st.DataObject) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.tokens[rid] = tokens
        hits = self.kv.get_computed_blocks(rid, tokens)
        assert len(hits) * BLOCK_SIZE < len(tokens), "at least one token left to compute"
        num_computed = len(hits) * BLOCK_SIZE
        if not self._write(rid, num_computed, data.draw(st.integers(1, len(tokens) - num_computed)), hits):
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
        self.tokens[child] = self.tokens[parent][:n] + [diverge]
        self.computed[child] = n - 1
        if not self._write(child, n - 1, 2):  # as the scheduler would preempt it: recompute from scratch
            self.kv.forget(child)  # (a child never computed is never forked again: chained forks that
            del self.tokens[child], self.computed[child]  # each step back a token outrun LAG)

    @invariant()
    def refcounts_match_tables(self) -> None:
        pool, owners = self.kv.block_pool, [0] * NUM_BLOCKS
        for tables in self.kv.req_to_blocks.values():
            for b in (b for t in tables for b in t if b != NULL_BLOCK):
                owners[b] += 1
        for b in range(NUM_BLOCKS):
            assert pool.ref_counts[b] == owners[b] and pool.is_free(b) == (owners[b] == 0)
        cpu_owned = [b for ts in self.kv.req_to_cpu_blocks.values() for t in ts for b in t if b != NULL_BLOCK]
        assert len(cpu_owned) == len(set(cpu_owned))
        assert self.kv.cpu_pool is not None and self.kv.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS - len(cpu_owned)

    @invariant()
    def requests_read_their_window(self) -> None:
        for rid, toks in self.tokens.items():
            store, tables = ((self.cpu, self.kv.req_to_cpu_blocks[rid]) if rid in self.swapped
                             else (self.dev, self.kv.req_to_blocks[rid]))
            c = self.computed[rid]
            for g, (group, table) in enumerate(zip(GROUPS, tables)):
                first = 0 if group.window is None else max(0, c - group.window + 1)
                for p in range(first, c):
                    assert table[p // BLOCK_SIZE] != NULL_BLOCK, (rid, g, p)
                    assert store[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] == (g, toks[p]), (rid, g, p)

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        pool = self.kv.block_pool
        for b, h in enumerate(pool.block_hashes):
            if h is not None:
                assert tuple(t for _, t in self.dev[b]) == h.token_ids
                assert len({g for g, _ in self.dev[b]}) == 1, "one group wrote the whole block"
                assert pool.get_cached_block(h) == b

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.kv.forget(rid)
        assert self.kv.num_free_blocks == NUM_BLOCKS, "pool returns to fully free"
        assert self.kv.cpu_pool is not None and self.kv.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS


HybridKVMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestHybridKVMachine = HybridKVMachine.TestCase


def test_gemma3_groups() -> None:
    # Gemma 3 270m: 18 layers, layer i global when i % 6 == 5 -> 1 full + 5 sliding groups of 3 layers.
    groups = kv_groups(18, tuple(i for i in range(18) if i % 6 < 5), 512)
    assert [g.window for g in groups] == [None] + [512] * 5
    assert groups[0].layers == (5, 11, 17) and groups[1].layers == (0, 1, 2)
    assert sorted(i for g in groups for i in g.layers) == list(range(18))
    assert kv_groups(4, None, None) == [KVGroup(None, (0, 1, 2, 3))]


def test_long_request_holds_its_window_only() -> None:
    kv = HybridKVCacheManager(kv_groups(6, (0, 1, 2, 3, 4), 32), 400, 16)
    assert kv.allocate_slots("a", 0, 64) == []
    for c in range(64, 1024):  # decode one token at a time
        assert kv.allocate_slots("a", c, 1) == []
    full, *sliding = kv.req_to_blocks["a"]
    assert NULL_BLOCK not in full and len(full) == 64
    assert all(sum(b != NULL_BLOCK for b in t) <= 3 for t in sliding), "window 32 spans at most 3 blocks"
    assert kv.get_block_tables("a")[1][0] == 0, "NULL slots reach the runner as block 0"
    kv.forget("a")
    assert kv.num_free_blocks == 400


def test_fork_inside_given_back_window_is_refused() -> None:
    kv = HybridKVCacheManager(kv_groups(2, (0,), 4), 16, 4)
    kv.allocate_slots("p", 0, 16)
    kv.allocate_slots("p", 16, 1)  # blocks before position 16 - 4 + 1 - LAG = 11 go back: blocks 0, 1
    try:
        kv.fork("p", "c", 9)  # the child recomputes position 8, whose window starts in block 1
    except RuntimeError as e:
        assert "window" in str(e)
    else:
        raise AssertionError("fork into a given-back window must fail")


def test_fork_after_the_parents_next_step_was_allocated() -> None:
    # Async scheduling: the parent (7-token prompt, window 4) has its next two steps allocated when
    # the child forks and recomputes position 6, whose window starts at position 3, in block 0.
    kv = HybridKVCacheManager(kv_groups(2, (0,), 4), 16, 4)
    kv.allocate_slots("p", 0, 7)
    kv.allocate_slots("p", 7, 1)
    kv.allocate_slots("p", 8, 1)
    kv.fork("p", "c", 7)
    assert kv.allocate_slots("c", 6, 1) is not None and kv.req_to_blocks["c"][1][0] != NULL_BLOCK


def test_bad_layout_is_refused() -> None:
    for bad in ((4, (5,), 8), (4, (0,), 0)):
        try:
            kv_groups(*bad)
        except ValueError as e:
            assert "sliding" in str(e)
        else:
            raise AssertionError(bad)


# -- the scheduler with KV groups, against the fake runner's reference outputs ----------------------
class WindowRunner(scheduler_helpers.FakeRunner):
    """FakeRunner that also writes every group's table and, before sampling, reads back each group's
    (group, token, position) at every position that group attends: the whole context for a full group,
    the window for a sliding one."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        super().__init__(cfg)
        self.gdev: list[list[tuple | None]] = [[None] * cfg.block_size for _ in range(cfg.num_blocks)]
        self.gcpu: list[list[tuple | None]] = [[None] * cfg.block_size for _ in range(cfg.num_cpu_blocks)]

    def write(self, out: SchedulerOutput) -> None:
        super().write(out)
        bs = self.cfg.block_size
        for d, c in out.swap_out:
            self.gcpu[c] = list(self.gdev[d])
        for c, d in out.swap_in:
            self.gdev[d] = list(self.gcpu[c])
        for s, d in out.copy_blocks:
            self.gdev[d] = list(self.gdev[s])
        for sr in out.scheduled:
            assert sr.block_tables is not None and sr.block_tables[0] == sr.block_ids
            for p in range(sr.start_pos, sr.start_pos + len(sr.token_ids)):
                t = self.dev[sr.block_ids[p // bs]][p % bs][0]  # placeholders resolved by FakeRunner
                for g, table in enumerate(sr.block_tables):
                    self.gdev[table[p // bs]][p % bs] = (g, t, p)

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.write(out)
        bs = self.cfg.block_size
        for sr in out.scheduled:
            end = sr.start_pos + len(sr.token_ids)
            ctx = self.context(sr, end)
            for g, (group, table) in enumerate(zip(self.cfg.kv_groups, sr.block_tables)):
                first = 0 if group.window is None else max(0, sr.start_pos - group.window + 1)
                for p in range(first, end):
                    assert self.gdev[table[p // bs]][p % bs] == (g, ctx[p], p), (sr.request_id, g, p)
        sampled = {sr.request_id: SampledToken(scheduler_helpers.next_token(
            self.context(sr, sr.start_pos + len(sr.token_ids)), scheduler_helpers.salt(sr.request_id)))
            for sr in out.scheduled if sr.sample}  # FakeRunner.execute's sampling, after the one write
        self.last = sampled
        return ModelOutput(sampled)


@pytest.mark.parametrize("mode, chunked, caching, async_scheduling", [
    ("recompute", True, True, False), ("recompute", False, False, True), ("swap", True, True, True)])
def test_scheduler_with_window_groups(monkeypatch: pytest.MonkeyPatch, mode: str, chunked: bool,
                                      caching: bool, async_scheduling: bool) -> None:
    """Preemption, chunked prefill, prefix caching, n = 3 forks and async scheduling with a tight pool:
    every request's tokens equal the cache-free reference and every group reads its window back."""
    monkeypatch.setattr(scheduler_helpers, "FakeRunner", WindowRunner)
    rng = random.Random(7)
    cfg = SchedulerConfig(num_blocks=60, block_size=4, max_num_seqs=6, max_model_len=64,
                          max_num_batched_tokens=24 if chunked else 64, enable_chunked_prefill=chunked,
                          enable_prefix_caching=caching, preemption_mode=mode,
                          num_cpu_blocks=40 if mode == "swap" else 0, kv_groups=tuple(kv_groups(3, (0, 2), 6)))
    shared = scheduler_helpers.random_prompt(rng, 12, 12)
    arrivals, reqs = [], []
    for i in range(10):
        prompt = (shared if i % 3 == 0 else []) + scheduler_helpers.random_prompt(rng, 4, 30)
        for k in range(3 if i % 4 == 1 else 1):
            req = scheduler_helpers.make_request(f"q{i}" if k == 0 else f"q{i}#{k}", prompt, arrival=float(i),
                                                 parent=f"q{i}" if k else None, max_tokens=20, ignore_eos=True)
            arrivals.append((i, req))
            reqs.append(req)
    result = scheduler_helpers.run(cfg, arrivals, async_scheduling=async_scheduling)
    scheduler_helpers.assert_matches_reference(result, reqs, cfg.max_model_len)
    assert any(o.preempted_ids for o in result.steps), "the pool was meant to be tight"
