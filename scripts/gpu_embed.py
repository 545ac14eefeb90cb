"""BERT embedding throughput on the device: requests/s and tokens/s at batch 64 of ~128 tokens.

Two encoder shapes with random weights (written here as an HF directory: config.json, safetensors and a
word-level tokenizer.json; nothing downloaded): all-MiniLM-L6-v2's (6 layers, 384 wide) and a bge-base-like
one (12 layers, 768 wide). For each, LLMEngine with the encoder runner (the core scheduler packing [B, S] batches,
the jitted programs, --dtype auto: bfloat16 on a GPU) runs `--reps` batches of `--batch` requests of
`--tokens` - 1/8 .. `--tokens` token ids, and the [B, S] program alone is timed on device-resident inputs:

    BRIEF embed minilm (6x384 bfloat16): engine 5000 req/s 600000 tok/s | program [64,128] 4.1 ms ...

Usage: python scripts/gpu_embed.py [--shapes minilm bge-base] [--batch 64] [--tokens 128] [--reps 20]
       python scripts/gpu_embed.py --cpu-smoke        # tiny shapes on a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 30522
SHAPES = {  # name -> (layers, hidden, heads, intermediate)
    "minilm": (6, 384, 12, 1536),
    "bge-base": (12, 768, 12, 3072),
    "tiny": (2, 32, 4, 64),
}


def write_model(out: Path, shape: str, vocab: int) -> None:
    """A random BertModel directory (N(0, 0.02) weights, unit LayerNorms) with a word-level tokenizer."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    layers, hidden, heads, inter = SHAPES[shape]
    cfg = {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu"}
    (out / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    rand = lambda *s: (rng.standard_normal(s, dtype=np.float32) * 0.02)  # noqa: E731
    t = {"embeddings.word_embeddings.weight": rand(vocab, hidden),
         "embeddings.position_embeddings.weight": rand(512, hidden),
         "embeddings.token_type_embeddings.weight": rand(2, hidden),
         "embeddings.LayerNorm.weight": np.ones(hidden, np.float32), "embeddings.LayerNorm.bias": rand(hidden)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            t[p + name + ".weight"], t[p + name + ".bias"] = rand(hidden, hidden), rand(hidden)
        t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"] = rand(inter, hidden), rand(inter)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = rand(hidden, inter), rand(hidden)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + ln + ".weight"], t[p + ln + ".bias"] = np.ones(hidden, np.float32), rand(hidden)
    save_file(t, str(out / "model.safetensors"))
    words = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, vocab)}}
    Tokenizer(models.WordLevel(words, unk_token="[UNK]")).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def measure(shape: str, batch: int, tokens: int, reps: int, cache: str) -> str:
    import jax

    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.entrypoints.pooling_offline import run_to_completion

    layers, hidden = SHAPES[shape][:2]
    vocab = VOCAB if shape != "tiny" else 512
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), shape, vocab)
        t0 = time.perf_counter()
        engine = LLMEngine(EngineArgs(model=tmp, runner="pooling", dtype="auto", max_num_seqs=batch,
                                          max_num_batched_tokens=batch * tokens, max_model_len=tokens,
                                          compilation_cache_dir=cache), progress=False)
        warmup_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    lengths = rng.integers(tokens - tokens // 8, tokens + 1, size=batch * reps)
    inputs = [(rng.integers(2, vocab, size=int(n)).tolist(), None) for n in lengths]
    run_to_completion(engine, inputs[:batch])  # the first call's one-off costs
    t0 = time.perf_counter()
    rows = run_to_completion(engine, inputs)
    wall = time.perf_counter() - t0
    assert len(rows) == len(inputs) and all(np.isfinite(r).all() for r in rows[:4])

    program = engine.runner._programs[batch, tokens]  # the [B, S] program alone, inputs on the device
    ids = jax.device_put(np.stack([np.resize(np.asarray(i[0], np.int32), tokens) for i in inputs[:batch]]))
    types = jax.device_put(np.zeros((batch, tokens), np.int32))
    lens = jax.device_put(lengths[:batch].astype(np.int32))
    program(engine.model.params, ids, types, lens).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = program(engine.model.params, ids, types, lens)
    out.block_until_ready()
    step = (time.perf_counter() - t0) / reps
    stats = engine.get_stats()
    dtype = str(engine.model.params["word_embed"].dtype)
    n_tok = int(lengths.sum())
    engine.shutdown()
    return (f"embed {shape} ({layers}x{hidden} {dtype}): engine {len(inputs) / wall:.0f} req/s "
            f"{n_tok / wall:.0f} tok/s ({len(inputs)} requests of {tokens - tokens // 8}-{tokens} tokens) | "
            f"program [{batch},{tokens}] {step * 1e3:.2f} ms = {batch / step:.0f} req/s "
            f"{batch * tokens / step:.0f} padded tok/s | engine/program {len(inputs) / wall * step / batch:.2f} | "
            f"warm-up {warmup_s:.0f}s, {stats.num_compilations_after_warmup} compilations after it")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["minilm", "bge-base"], choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compilation-cache-dir", default="")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes: --shapes tiny --batch 8 --tokens 16")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.shapes, args.batch, args.tokens, args.reps = ["tiny"], 8, 16, 3
    import jax

    print(f"backend {jax.default_backend()}: {jax.devices()[0].device_kind}")
    for shape in args.shapes:
        print("BRIEF " + measure(shape, args.batch, args.tokens, args.reps, args.compilation_cache_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
