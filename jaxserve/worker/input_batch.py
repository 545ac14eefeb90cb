"""Pack a SchedulerOutput into one flat, padded device batch.

    requests  A (prefill chunk, 5 tokens)  B (decode)  C (decode)   padding
    tokens    a0 a1 a2 a3 a4               b7          c3           -  -  ...  (T = token bucket)
    cu_q_lens 0              5              6           7  7 7 ...              (max_num_seqs + 1)
    logits_indices  4 (only if A samples)  5           6  0 0 ...              (S = seq bucket)

The attention metadata keeps max_num_seqs rows whatever the batch, so the model
step compiles once per token bucket; only the sampler sees the seq bucket S.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.core.request import PLACEHOLDER
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.models.attention import AttentionMetadata
from jaxserve.worker import kv_groups


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    token_ids: jax.Array  # [T] i32, 0 for padding
    positions: jax.Array  # [T] i32
    # [T] i32, async scheduling: the row of the previous step's sampled ids that is this token
    # (a decode input still on the device), else -1
    prev_rows: jax.Array
    attn: AttentionMetadata  # slot_mapping [T]; kv_lens, block_tables, cu_q_lens over max_num_seqs rows
    # [T] i32, the LoRA slot of each token's adapter (0: the base model, and padding); see jaxserve/lora
    lora_slots: jax.Array
    # a vision-language model's step with image rows (jaxserve/multimodal/runner.py): [T, hidden] rows
    # that replace the embeddings where mm_mask [T] is set; None in every other step (and model)
    mm_embeds: jax.Array | None = None
    mm_mask: jax.Array | None = None


def buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from lo, capped by (and always including) hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def token_buckets(lo: int, hi: int) -> list[int]:
    """The model step's token buckets: powers of two, plus the 1.5x midpoints from 64 tokens on.

    A step's compute is proportional to its padded token count, and steps carrying
    one new prompt next to the decodes (160-300 tokens) are common: powers of two
    alone padded those up to 2x, the midpoints cap padding at 1.5x for a few more
    programs to compile (3 up to 512 tokens).
    """
    grid = set(buckets(lo, hi))
    grid.update(b + b // 2 for b in list(grid) if b >= 64 and b + b // 2 < hi)
    return sorted(grid)


# The smallest token bucket. A batch's last few sequences run steps of 1-8 decode tokens (39% of
# a 32-request run's time on the CPU); there (int8 SmolLM2-135M, 64-token blocks) the 8-token
# program ran them 1.3-1.4x faster than the 16-token one, and the 4-token program 1.2-1.3x faster
# again. The 2-token program saved another 3 ms on 1-2 tokens (and a 1-token one nothing), less
# than its compile costs every cold start (BENCHMARKS.md, "Small buckets for a batch's tail").
MIN_TOKEN_BUCKET = 4


def step_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """The model step's token buckets for a `max_num_batched_tokens` budget."""
    return token_buckets(MIN_TOKEN_BUCKET, max(MIN_TOKEN_BUCKET, max_num_batched_tokens))


def step_seq_buckets(max_num_seqs: int) -> list[int]:
    """The sampler's request-count buckets for a `max_num_seqs` budget (powers of two from 8)."""
    return buckets(8, max(8, max_num_seqs))


# The Pallas (GPU) backend's grids. A GPU step of up to a few hundred tokens reads the weights once
# whatever its token count (Llama-3.1-8B: 16 GB, ~5 ms at 3.3 TB/s, against ~1.5 ms of matmuls at
# 64 tokens), so padding small steps up costs little, and the larger steps are mostly full
# prefill chunks. Every program dropped is one XLA GPU compile (GEMM autotuning, Triton) less in a
# cold warm-up: 11 model programs and 3 sampler buckets at 2048 tokens / 256 seqs, against 15 and 6.
PALLAS_MIN_MIXED_BUCKET = 64
PALLAS_MIN_DECODE_BUCKET = 16


def pallas_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token buckets of the Pallas backend's mixed (ragged kernel) steps: powers of two from 64."""
    return buckets(PALLAS_MIN_MIXED_BUCKET, max(PALLAS_MIN_MIXED_BUCKET, max_num_batched_tokens))


def pallas_decode_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Token buckets of its decode-only (decode kernel) steps: powers of two from 16 up to the most
    sequences a step can carry."""
    top = max(PALLAS_MIN_DECODE_BUCKET, min(max_num_seqs, max_num_batched_tokens))
    return buckets(PALLAS_MIN_DECODE_BUCKET, top)


def pallas_seq_buckets(max_num_seqs: int) -> list[int]:
    """Its sampler buckets: powers of four from 16 (the LM head reads its weights once up to
    hundreds of rows; the sampler's sort over the vocabulary is the part that grows with rows)."""
    out, b = [], 16
    while b < max_num_seqs:
        out.append(b)
        b *= 4
    return out + [max(16, max_num_seqs)]


def step_grids(pallas: bool, max_num_seqs: int, max_num_batched_tokens: int,
               one_row: bool = False) -> tuple[list[int], list[int], list[int]]:
    """The model step's token buckets, its decode-only buckets (Pallas only) and the sampler's seq buckets.
    one_row (CPU only, `one_row_buckets`): a 1-token model bucket and a 1-row sampler bucket first."""
    if pallas:
        return (pallas_token_buckets(max_num_batched_tokens),
                pallas_decode_buckets(max_num_seqs, max_num_batched_tokens), pallas_seq_buckets(max_num_seqs))
    tokens, seqs = step_token_buckets(max_num_batched_tokens), step_seq_buckets(max_num_seqs)
    return ([1] + tokens, [], [1] + seqs) if one_row else (tokens, [], seqs)


def one_row_buckets(params: object) -> bool:
    """Whether a one-sequence decode step runs with one row rather than padded to the smallest
    buckets: for weights kept as a GGUF's blocks (`--quantization gguf`), whose one-row product is
    XLA:CPU's fused pass over the int8 values while more rows take the tile-by-tile form
    (quantization/gguf_packed.matmul): 0.5B Q4_K_M, the LM head alone 102 ms at 8 rows. float32 and
    int8 weights: measured in docs/benchmarks/log.md ("Batch-1 decode"), not taken."""
    from jaxserve.quantization.gguf_packed import holds_gguf

    return holds_gguf(params)


def is_decode_only(out: SchedulerOutput) -> bool:
    """Every scheduled sequence has exactly one new token (no prompt chunk, no drafts)."""
    return bool(out.scheduled) and all(len(sr.token_ids) == 1 for sr in out.scheduled)


def bucket_for(n: int, grid: list[int]) -> int:
    for b in grid:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {grid[-1]}")


def pack(out: SchedulerOutput, num_tokens_padded: int, max_num_seqs: int, max_blocks_per_seq: int,
         block_size: int, prev_sample_rows: Mapping[str, int] | None = None, *,
         decode_only: bool = False, lora_slots: Mapping[int, int] | None = None,
         num_groups: int = 1) -> tuple[StepInput, list[int]]:
    """Host-side numpy batch, and the flat rows to sample (in order): each sampling request's last
    token, preceded by its last real token's row and its other drafts' when it carries drafts.
    `prev_sample_rows`: request id -> its row in the previous step's sampled ids, for PLACEHOLDER inputs.
    decode_only (static in the metadata: its own compiled program) needs is_decode_only(out).
    lora_slots: LoRA adapter id -> its device slot, for requests with an adapter (lora_int_id > 0).
    num_groups > 1: the pool's KV groups (worker/kv_groups.py): every group's tables and slots too."""
    if decode_only and not is_decode_only(out) and out.scheduled:
        raise ValueError("decode_only: a scheduled request has more than one new token")
    prev_rows_by_id = prev_sample_rows or {}
    tokens = np.zeros(num_tokens_padded, np.int32)
    prev_rows = np.full(num_tokens_padded, -1, np.int32)
    positions = np.zeros(num_tokens_padded, np.int32)
    slots = np.full(num_tokens_padded, -1, np.int32)
    adapter_slots = np.zeros(num_tokens_padded, np.int32)
    kv_lens = np.zeros(max_num_seqs, np.int32)
    tables = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
    cu = np.zeros(max_num_seqs + 1, np.int32)
    sample_rows: list[int] = []
    t = 0
    for i, sr in enumerate(out.scheduled):
        n = len(sr.token_ids)
        pos = np.arange(sr.start_pos, sr.start_pos + n, dtype=np.int32)
        blocks = np.asarray(sr.block_ids, np.int32)
        tokens[t:t + n] = sr.token_ids
        if sr.token_ids[-1] == PLACEHOLDER:  # only ever a decode's one input (see Scheduler._ready)
            tokens[t + n - 1] = 0
            prev_rows[t + n - 1] = prev_rows_by_id[sr.request_id]
        positions[t:t + n] = pos
        if sr.lora_int_id:
            adapter_slots[t:t + n] = lora_slots[sr.lora_int_id]
        slots[t:t + n] = blocks[pos // block_size] * block_size + pos % block_size
        kv_lens[i] = sr.start_pos + n
        tables[i, :len(blocks)] = blocks
        t += n
        cu[i + 1] = t
        if sr.sample:  # the last token's row, and one after each speculative draft
            sample_rows.extend(range(t - 1 - sr.num_drafts, t))
    cu[len(out.scheduled) + 1:] = t
    groups = (None, None) if num_groups == 1 else kv_groups.pack_groups(
        out, num_tokens_padded, max_num_seqs, max_blocks_per_seq, block_size, num_groups)
    attn = AttentionMetadata(slot_mapping=slots, kv_lens=kv_lens, block_tables=tables, cu_q_lens=cu,
                             num_seqs=np.asarray([len(out.scheduled)], np.int32), decode_only=decode_only,
                             group_block_tables=groups[0], group_slot_mapping=groups[1])
    return StepInput(tokens, positions, prev_rows, attn, adapter_slots), sample_rows
