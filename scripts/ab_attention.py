"""A/B of the CPU attention path inside the whole model step: a git revision against the work tree.

Loads `pallas_kernels/reference_core.py` as it was at REV (through `git show`) next
to the current one, jits the SmolLM2-135M-shaped model step (random float32 weights,
or with --quantization int8 their int8 form; a pool of 23296 tokens in blocks of
--block-size, float32 or, with --kv-cache-dtype bfloat16, bfloat16 bits) once with
each, and times them interleaved in one process on seven batches: 32 decode tokens
at context 250, 22 decode tokens with log-normal contexts (median 300), prefills of
4 x 128 and 1 x 512 fresh tokens, 28 decode tokens next to 2 x 128 or 1 x 484 prompt
tokens, and the second 512-token chunk of a 1024-token prompt. Medians of --reps
calls each.

    .venv/bin/python scripts/ab_attention.py --rev 8ff7d07
    .venv/bin/python scripts/ab_attention.py --rev HEAD --block-size 64 --kv-cache-dtype bfloat16
    .venv/bin/python scripts/ab_attention.py --rev HEAD --block-size 64 --kv-cache-dtype bfloat16 \
        --quantization int8 --only decode, --reps 31
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.args import KV_CACHE_DTYPES, QUANTIZATIONS
from jaxserve.models import attention, llama
from jaxserve.models.config import ModelConfig
from jaxserve.models.attention import AttentionMetadata
from jaxserve.quantization.quantize import calibration_ids, quantize_params
from pallas_kernels import reference_core
from pallas_kernels.common import token_positions

ROOT = Path(__file__).resolve().parent.parent
CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                  rope_theta=100000.0, tie_word_embeddings=True)
NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS = 1456, 16, 64, 128


def load_revision(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:pallas_kernels/reference_core.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "reference_core_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("reference_core_rev", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attend_with(core):
    """attention.attend over `core.attend_reference`, whichever signature it has."""
    with_seqs = "seq_ids" in inspect.signature(core.attend_reference).parameters

    def attend(backend, q, k_cache, v_cache, md, layer, *, sm_scale, sliding_window):
        seq_ids, q_pos = token_positions(md.cu_q_lens, md.kv_lens, md.num_seqs[0], q.shape[0])
        extra = ()
        if with_seqs:
            cu = md.cu_q_lens
            extra = (seq_ids, md.kv_lens[seq_ids] - (cu[seq_ids + 1] - cu[seq_ids]))
        return core.attend_reference(q, k_cache, v_cache, md.block_tables[seq_ids], q_pos, *extra,
                                     sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=None,
                                     layer=layer)
    return attend


def make_step(attend):
    def step(params, kv, tokens, positions, md):
        attention.attend = attend  # read when tracing: each jitted step keeps its own
        return llama.forward(params, CFG, kv, tokens, positions, md, "xla")
    return jax.jit(step, donate_argnums=1)


def make_batch(rng, seqs, num_tokens):
    """seqs: (start position, new tokens) per sequence, on distinct random blocks."""
    tokens, pos = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    kv_lens, tables = np.zeros(MAX_SEQS, np.int32), np.zeros((MAX_SEQS, MAX_BLOCKS), np.int32)
    cu = np.zeros(MAX_SEQS + 1, np.int32)
    perm, used, t = rng.permutation(NUM_BLOCKS), 0, 0
    for i, (start, n) in enumerate(seqs):
        nblk = -(-(start + n) // BLOCK_SIZE)
        blocks, used = perm[used:used + nblk], used + nblk
        p = np.arange(start, start + n)
        tokens[t:t + n], pos[t:t + n] = rng.integers(0, CFG.vocab_size, n), p
        slots[t:t + n] = blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        kv_lens[i], tables[i, :nblk], t = start + n, blocks, t + n
        cu[i + 1] = t
    cu[len(seqs) + 1:] = t
    md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu),
                           jnp.asarray([len(seqs)], np.int32))
    return jnp.asarray(tokens), jnp.asarray(pos), md


def main() -> None:
    global NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", required=True, help="git revision for side A (side B: the work tree)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help="tokens per KV block (the pool's token count is kept)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    p.add_argument("--only", default="", help="run the batches whose name contains this text")
    args = p.parse_args()
    NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = (NUM_BLOCKS * BLOCK_SIZE // args.block_size, args.block_size,
                                          MAX_BLOCKS * BLOCK_SIZE // args.block_size)

    rng = np.random.default_rng(0)
    shapes = llama.param_shapes(CFG)
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32) * 0.02, shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    if args.quantization:  # calibrated on fixed spread-out ids (no tokenizer)
        params = quantize_params(params, CFG, args.quantization, calibration_ids(None, CFG.vocab_size))
    kv = attention.make_kv_cache(CFG.num_layers, CFG.num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, CFG.head_dim,
                                 attention.kv_pool_dtype(args.kv_cache_dtype, jnp.float32, "xla"))
    steps = {args.rev: make_step(attend_with(load_revision(args.rev))),
             "work tree": make_step(attend_with(reference_core))}
    ctx = np.clip(np.round(300 * np.exp(0.7 * rng.standard_normal(22))), 16, 1500).astype(int)
    cases = {"32 decode, context 250": ([(250, 1)] * 32, 32),
             "22 decode, log-normal contexts": ([(int(c), 1) for c in ctx], 32),
             "prefill 4 x 128": ([(0, 128)] * 4, 512),
             "prefill 1 x 512": ([(0, 512)], 512),
             "28 decode + 2 x 128 prompt": ([(250, 1)] * 28 + [(0, 128)] * 2, 512),
             "28 decode + 484 prompt": ([(250, 1)] * 28 + [(0, 484)], 512),
             "512-token chunk after 512 cached": ([(512, 512)], 512)}
    print(f"| batch | {args.rev} ms | work tree ms | ratio |\n|---|---:|---:|---:|")
    for i, (name, (seqs, num_tokens)) in enumerate(cases.items()):
        if args.only not in name:
            continue
        batch = make_batch(np.random.default_rng(1 + i), seqs, num_tokens)  # the same with or without --only
        times = {k: [] for k in steps}
        for rep in range(args.reps + 1):
            for k, f in steps.items():
                t0 = time.perf_counter()
                kv, h = f(params, kv, *batch)
                h.block_until_ready()
                if rep:  # the first call compiles
                    times[k].append(time.perf_counter() - t0)
        a, b = (float(np.median(times[k])) * 1e3 for k in steps)
        print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
