"""Sliding-window KV groups on the runner side (issue 49; vLLM's hybrid KV cache allocator).

The scheduler side (core/hybrid_kv_cache_manager.py) splits a model's layers into G groups of k layers
of one kind (Gemma 3: 1 full + 5 sliding groups when k = gcd(#full, #sliding)) and gives each request
one block table per group; a sliding group's blocks wholly before its window go back to the pool. Here:

    pool         K and V each [k, kv_heads, num_blocks, block_size, head_dim]: a block id is a page of
                 k layers' K/V for whichever group holds it (a full-attention model: k = num_layers)
    batch        AttentionMetadata.group_block_tables [G, S, B] and group_slot_mapping [G, T]
    layer scan   layer i reads group g(i)'s table and pool slot s(i) (attention.group_view), both as
                 data: one compiled layer body for every group
    sizing       a block is k / num_layers of a full model's; a request at its longest still needs G
                 tables of its whole length (a recompute refills every group in one step), so the
                 smallest pool is G * ceil(max_model_len / block_size) of these blocks

Only families whose layer scan reads group_view take groups (GROUPED_FAMILIES); every other model, and
configurations that slice or rebuild the batch per layer or per stage (pipeline parallel,
--batch-invariant), keep the one-table pool and programs exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.core.hybrid_kv_cache_manager import LAG, KVGroup, kv_groups
from jaxserve.core.scheduler_output import SchedulerOutput

# Families whose own layer scan reads its group's table (models/gemma.py); Mistral-style models whose
# every layer slides are one group (k = num_layers) and stay on the one-table path.
GROUPED_FAMILIES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True)
class KVLayout:
    """The KV groups a runner's pool and batch are laid out for (hashable: part of RunnerConfig)."""
    groups: tuple[KVGroup, ...]

    @property
    def size(self) -> int:
        """k: the layers one block holds, the pool's leading axis."""
        return len(self.groups[0].layers)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def bytes_per_block(self, full_block_bytes: int, num_layers: int) -> int:
        """One block's bytes from a one-table block's (num_layers layers' K and V)."""
        return full_block_bytes // num_layers * self.size

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """The blocks one request of num_tokens holds between steps: every full group its whole length,
        every sliding group its window (plus LAG tokens, and the block the window starts in)."""
        whole = -(-num_tokens // block_size)
        return sum(whole if g.window is None else min(whole, -(-(g.window - 1 + LAG) // block_size) + 1)
                   for g in self.groups)

    def describe(self) -> str:
        """The start-up log's words for the layout."""
        full = sum(g.window is None for g in self.groups)
        return (f"; each block holds {self.size} layer{'s' if self.size > 1 else ''} of one of {full} full-attention and "
                f"{self.num_groups - full} sliding-window KV groups")

    def min_blocks(self, max_model_len: int, block_size: int) -> int:
        """The blocks one request of max_model_len may need at once (the admission check's figure)."""
        return -(-max_model_len // block_size) * self.num_groups


def kv_layout(cfg, max_model_len: int, pipeline_parallel_size: int = 1,  # noqa: ANN001 (ModelConfig)
              batch_invariant: bool = False) -> KVLayout | None:
    """The groups for this model and configuration, or None: one table (a model without both kinds of
    layer, a window no request can outgrow, a family whose scan reads one table, PP, --batch-invariant)."""
    window = cfg.sliding_window
    if (cfg.architecture not in GROUPED_FAMILIES or not cfg.sliding_layers or window is None
            or window >= max_model_len or pipeline_parallel_size > 1 or batch_invariant):
        return None
    groups = kv_groups(cfg.num_layers, cfg.sliding_layers, window)
    return KVLayout(tuple(groups)) if len(groups) > 1 else None


def pack_groups(out: SchedulerOutput, num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                block_size: int, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Every group's block tables [G, S, B] and slot mappings [G, T] (-1: padding) of a step, in the
    order input_batch.pack lays out its tokens; a sliding group's given-back slots read block 0
    (before the window: never attended, the kernels start at the window's first block)."""
    tables = np.zeros((num_groups, max_num_seqs, max_blocks_per_seq), np.int32)
    slots = np.full((num_groups, num_tokens), -1, np.int32)
    t = 0
    for i, sr in enumerate(out.scheduled):
        n = len(sr.token_ids)
        if sr.block_tables is None or len(sr.block_tables) != num_groups:
            raise ValueError(f"request {sr.request_id}: the runner's pool has {num_groups} KV groups; "
                             "the scheduler sent no table for each")
        pos = np.arange(sr.start_pos, sr.start_pos + n)
        for g, table in enumerate(sr.block_tables):
            blocks = np.asarray(table, np.int32)
            tables[g, i, :len(blocks)] = blocks
            slots[g, t:t + n] = blocks[pos // block_size] * block_size + pos % block_size
        t += n
    return tables, slots
