"""One DeepSeek prefill step's latent attention on the XLA (CPU) path: the absorbed form against the
expanded one (models/mla_prefill.py), DeepSeek-V2-Lite's attention shape, random float32 weights.

Shape (config.json of deepseek-ai/DeepSeek-V2-Lite): 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64,
v 128; the latent pool of 16-token blocks. One sequence, N new tokens after C cached ones (their pool
entries already written, as in the engine). Times each token's per-head output before W_O (the q and
kv projections and W_O are the same work in both forms):

    absorbed   W_UK into q, all heads over the pool as one MQA head of 576-wide keys, the 512 latent as
               values (the engine's XLA ragged path), then W_UV
    expanded   K and V up-projected from the latents, CHUNK_TOKENS positions at a time merged by their
               log-sum-exp, per-head attention over 192-wide keys

Both are checked equal first; prints one line per (N, C), what the rule (prefers_expanded) picks,
and a RESULT JSON line.

    .venv/bin/python scripts/bench_mla_prefill.py --new 64 256 1024 --cached 0 2048 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.models import mla, mla_prefill  # noqa: E402
from jaxserve.models.attention import AttentionMetadata  # noqa: E402
from jaxserve.models.config import MlaConfig  # noqa: E402

HEADS, RANK, NOPE, ROPE, V, BLOCK = 16, 512, 128, 64, 128, 16


class Cfg:  # the fields of ModelConfig the attention reads
    num_heads = HEADS
    mla = MlaConfig(kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                    softmax_scale=(NOPE + ROPE) ** -0.5)
    architecture = "DeepseekV2ForCausalLM"


def step(form: str):
    def run(lp, q_nope, q_pe, pool, md):
        mla_prefill.FORCE = form  # read while tracing
        absorbed = lambda: mla_absorbed(lp, q_nope, q_pe, pool, md)  # noqa: E731
        return mla_prefill.heads(Cfg, lp, q_nope, q_pe, pool, md, jnp.int32(0), absorbed)
    return jax.jit(run)


def mla_absorbed(lp, q_nope, q_pe, pool, md):
    q_abs = jnp.concatenate([jnp.einsum("thn,hnr->thr", q_nope, lp["w_uk"]), q_pe], axis=-1)
    out = mla.latent_attention(Cfg, q_abs, pool, md, jnp.int32(0), "xla")
    return jnp.einsum("thr,hvr->thv", out, lp["w_uv"])


def case(new: int, cached: int, rng: np.random.Generator):
    total = new + cached
    blocks = -(-total // BLOCK)
    pool = jnp.asarray(rng.standard_normal((1, 1, blocks + 1, BLOCK, RANK + ROPE), np.float32))
    table = jnp.asarray(1 + rng.permutation(blocks).astype(np.int32))[None]
    slots = (table[0][jnp.arange(cached, total) // BLOCK] * BLOCK + jnp.arange(cached, total) % BLOCK)
    md = AttentionMetadata(slot_mapping=slots.astype(jnp.int32), kv_lens=jnp.array([total], jnp.int32),
                           block_tables=table, cu_q_lens=jnp.array([0, new], jnp.int32),
                           num_seqs=jnp.array([1], jnp.int32))
    q_nope = jnp.asarray(rng.standard_normal((new, HEADS, NOPE), np.float32))
    q_pe = jnp.asarray(rng.standard_normal((new, HEADS, ROPE), np.float32))
    return q_nope, q_pe, pool, md


def timed(fn, args, reps: int) -> float:
    fn(*args).block_until_ready()  # compile and warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--cached", type=int, nargs="+", default=[0, 2048])
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    lp = {"w_uk": jnp.asarray(rng.standard_normal((HEADS, NOPE, RANK), np.float32) / np.sqrt(RANK)),
          "w_uv": jnp.asarray(rng.standard_normal((HEADS, V, RANK), np.float32) / np.sqrt(RANK))}
    absorbed, expanded = step("absorbed"), step("expanded")
    check = (lp, *case(40, 300, rng))
    np.testing.assert_allclose(absorbed(*check), expanded(*check), rtol=1e-4, atol=1e-4)
    rows = []
    print(f"{'new':>5} {'cached':>7} {'absorbed ms':>12} {'expanded ms':>12} {'exp/abs':>8} rule")
    for cached in a.cached:
        for new in a.new:
            args = (lp, *case(new, cached, rng))
            t_abs, t_exp = timed(absorbed, args, a.reps), timed(expanded, args, a.reps)
            rule = bool(mla_prefill.prefers_expanded(Cfg, args[-1], new, BLOCK)) and new >= \
                mla_prefill.min_expanded_tokens(Cfg)
            rows.append(dict(new=new, cached=cached, absorbed_ms=t_abs * 1e3, expanded_ms=t_exp * 1e3,
                             rule="expanded" if rule else "absorbed"))
            print(f"{new:>5} {cached:>7} {t_abs * 1e3:>12.1f} {t_exp * 1e3:>12.1f} {t_exp / t_abs:>8.2f} "
                  f"{rows[-1]['rule']}", flush=True)
            del args
    print("RESULT " + json.dumps({"backend": jax.default_backend(), "chunk": mla_prefill.CHUNK_TOKENS,
                                  "weight": mla_prefill.EXPANDED_WEIGHT, "rows": rows}))


if __name__ == "__main__":
    main()
