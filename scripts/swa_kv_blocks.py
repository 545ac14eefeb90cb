"""KV pool held by one long request: Gemma 3's layer pattern (5 sliding : 1 global, window 512) with
sliding-window groups (jaxserve/core/hybrid_kv_cache_manager.py) against a full-attention model of the
same shape (KVCacheManager), driven as the scheduler drives them: chunked prefill, then decode.

    python scripts/swa_kv_blocks.py [--tokens 2048 32768] [--chunk 512]

Bytes assume Gemma 3 270m's shape (18 layers, 1 KV head, head_dim 256, bf16, block_size 16); a block
of the hybrid pool is a page of k = 3 layers, of the full pool a page of all 18, so both are counted in
layer-pages (block_size tokens of one layer) and bytes.
"""

from __future__ import annotations

import argparse

from jaxserve.core.hybrid_kv_cache_manager import HybridKVCacheManager, kv_groups
from jaxserve.core.kv_cache_manager import KVCacheManager

LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, BLOCK, WINDOW = 18, 1, 256, 2, 16, 512


def drive(kv: KVCacheManager, total: int, prompt: int, chunk: int) -> int:
    """Prefill `prompt` tokens in chunks, decode to `total`; the most blocks held at any step."""
    c, peak = 0, 0
    while c < total:
        n = min(chunk, prompt - c) if c < prompt else 1
        assert kv.allocate_slots("r", c, n) is not None, "pool too small"
        c += n
        peak = max(peak, kv.block_pool.num_blocks - kv.num_free_blocks)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    groups = kv_groups(LAYERS, tuple(i for i in range(LAYERS) if i % 6 < 5), WINDOW)
    k = len(groups[0].layers)
    page = BLOCK * KV_HEADS * HEAD_DIM * 2 * DTYPE_BYTES  # K and V, one layer
    print(f"{len(groups)} groups of {k} layers (1 full, {len(groups) - 1} sliding, window {WINDOW})")
    print("tokens | full-attn pages | hybrid pages (peak) | hybrid/full | full MiB | hybrid MiB")
    for total in args.tokens:
        nblocks = -(-total // BLOCK)
        full = KVCacheManager(nblocks, BLOCK)
        hybrid = HybridKVCacheManager(groups, nblocks * len(groups), BLOCK)
        full_peak = drive(full, total, total - 48, args.chunk) * LAYERS
        hyb_peak = drive(hybrid, total, total - 48, args.chunk) * k
        hyb_end = hybrid.num_held_blocks("r") * k
        print(f"{total} | {full_peak} | {hyb_end} ({hyb_peak}) | {hyb_end / full_peak:.3f} | "
              f"{full_peak * page / 2**20:.1f} | {hyb_end * page / 2**20:.1f}")


if __name__ == "__main__":
    main()
