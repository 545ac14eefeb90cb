"""KV pool a long request holds in the real engine: a random Gemma 3 of 270m's KV shape (18 layers, 15
sliding with window 512 and 3 global, 1 KV head of 256, bfloat16 pool, block_size 16; hidden 64 so the
CPU run is short) served with sliding-window KV groups and again with one table for every layer (the
engine as it was: `kv_layout` forced to None). The most pool bytes held at any step, from the
scheduler's free-block count times the runner's bytes per block; the greedy tokens of both runs must agree.

    python scripts/swa_kv_engine.py [--tokens 2048 8192] [--chunk 512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=18, num_attention_heads=4,
             num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768,
             query_pre_attn_scalar=256, tie_word_embeddings=True)


def save(out: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def run(path: Path, tokens: int, chunk: int, grouped: bool) -> tuple[int, int, list[int], float]:
    """(peak bytes held, bytes held at the last step, greedy tokens, seconds) of one request of `tokens`."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine import llm_engine
    from jaxserve.engine.args import EngineArgs

    real = llm_engine.kv_layout
    if not grouped:
        llm_engine.kv_layout = lambda *a, **k: None
    try:
        engine = llm_engine.LLMEngine(EngineArgs(
            model=str(path), dtype="float32", kv_cache_dtype="bfloat16", block_size=16, speculative_config={},
            max_model_len=tokens + 16, max_num_batched_tokens=chunk, max_num_seqs=1, kv_cache_memory=1 << 30,
            enforce_eager=True, compilation_cache_dir=""), progress=False)
    finally:
        llm_engine.kv_layout = real
    k = engine.runner.kv[0]
    per_block = 2 * k.dtype.itemsize * k.size // k.shape[2]
    prompt = [(37 * i) % 500 + 2 for i in range(tokens - 8)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    kv, peak, last, out, t0 = engine.scheduler.kv, 0, 0, None, time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o.outputs[0].token_ids if o.finished else out
        if "r" in kv.req_to_blocks:
            last = kv.block_pool.num_blocks - kv.num_free_blocks
            peak = max(peak, last)
    seconds = time.perf_counter() - t0
    engine.shutdown()
    return peak * per_block, last * per_block, list(out), seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = save(Path(tmp) / "gemma3-270m-shape")
        print("tokens | full-attention MiB peak, end | KV groups MiB peak, end | groups/full peak, end | "
              "tokens equal | s full, groups")
        for n in args.tokens:
            full, full_end, full_out, s_full = run(path, n, args.chunk, grouped=False)
            hyb, hyb_end, hyb_out, s_hyb = run(path, n, args.chunk, grouped=True)
            print(f"{n} | {full / 2**20:.1f}, {full_end / 2**20:.1f} | {hyb / 2**20:.1f}, {hyb_end / 2**20:.1f} | "
                  f"{hyb / full:.3f}, {hyb_end / full_end:.3f} | {full_out == hyb_out} | {s_full:.0f}, {s_hyb:.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
