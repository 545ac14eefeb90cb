"""One DeepSeek decode step's latent attention on the XLA (CPU) path: absorbed weights against the
expanded form, DeepSeek-V2-Lite's attention shape, random float32 weights.

Shape (config.json of deepseek-ai/DeepSeek-V2-Lite): hidden 2048, 16 heads, kv_lora_rank 512,
qk_nope 128, qk_rope 64, v 128, no q_lora_rank; the latent pool of 16-token blocks (the engine's
default), each sequence at the given context. One layer, one new token per sequence:

    absorbed   q_nope times W_UK into the latent space, all heads over the pool as one MQA head with
               576-wide keys and the 512 latent as values (pallas_kernels.mla_decode_reference, the
               engine's XLA path), then W_UV and W_O (models/mla.py)
    expanded   K and V up-projected from each sequence's cached latents (W_UK, W_UV: 16 x 128 each
               per token), per-head attention over nope + rope = 192-wide keys, then W_O: the form
               a latent cache decodes in without absorption (one sequence at a time, so the
               up-projected K and V of 64 x 8k tokens never sit in memory at once)

Both compute the same output (checked at the smallest setting). Prints one line per (sequences,
context) and a RESULT JSON line.

    .venv/bin/python scripts/bench_mla.py                                # 1, 16, 64 sequences x 1k, 8k
    .venv/bin/python scripts/bench_mla.py --seqs 1 16 --contexts 1024 --reps 3
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

HIDDEN, HEADS, RANK, NOPE, ROPE, V = 2048, 16, 512, 128, 64, 128
BLOCK = 16
SCALE = (NOPE + ROPE) ** -0.5


def weights(rng: np.random.Generator) -> dict:
    def w(*shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(fan_in))
    return {"wq": w(HIDDEN, HEADS * (NOPE + ROPE), fan_in=HIDDEN), "w_uk": w(HEADS, NOPE, RANK, fan_in=RANK),
            "w_uv": w(HEADS, V, RANK, fan_in=RANK), "wo": w(HEADS * V, HIDDEN, fan_in=HEADS * V)}


def query(lp: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    q = (x @ lp["wq"]).reshape(x.shape[0], HEADS, NOPE + ROPE)
    return q[..., :NOPE], q[..., NOPE:]  # the rotation of q_pe is the same work in both forms: left out


@jax.jit
def absorbed(lp, x, pool, kv_lens, tables):
    from pallas_kernels.mla_decode import mla_decode_reference

    q_nope, q_pe = query(lp, x)
    q_abs = jnp.concatenate([jnp.einsum("shn,hnr->shr", q_nope, lp["w_uk"]), q_pe], axis=-1)
    out = mla_decode_reference(q_abs, pool, kv_lens, tables, kv_lora_rank=RANK, sm_scale=SCALE)
    heads = jnp.einsum("shr,hvr->shv", out, lp["w_uv"])
    return heads.reshape(x.shape[0], HEADS * V) @ lp["wo"]


@jax.jit
def expanded(lp, x, pool, kv_lens, tables):
    q_nope, q_pe = query(lp, x)

    def one(args):
        qn, qp, kv_len, table = args
        cache = pool[0, table].reshape(-1, RANK + ROPE)  # [MB * BS, 576]: this sequence's latents
        k_nope = jnp.einsum("tr,hnr->htn", cache[:, :RANK], lp["w_uk"])  # [H, ctx, nope]
        v = jnp.einsum("tr,hvr->htv", cache[:, :RANK], lp["w_uv"])  # [H, ctx, v]
        s = (jnp.einsum("hn,htn->ht", qn, k_nope) + jnp.einsum("hp,tp->ht", qp, cache[:, RANK:])) * SCALE
        s = jnp.where(jnp.arange(cache.shape[0])[None] < kv_len, s, -jnp.inf)
        return jnp.einsum("ht,htv->hv", jax.nn.softmax(s, axis=-1), v)

    heads = jax.lax.map(one, (q_nope, q_pe, kv_lens, tables))  # [S, H, v]
    return heads.reshape(x.shape[0], HEADS * V) @ lp["wo"]


def case(lp: dict, seqs: int, context: int, rng: np.random.Generator):
    blocks = -(-context // BLOCK)
    pool = jnp.asarray(rng.standard_normal((1, seqs * blocks + 1, BLOCK, RANK + ROPE), np.float32))
    tables = jnp.asarray(1 + rng.permutation(seqs * blocks).reshape(seqs, blocks).astype(np.int32))
    kv_lens = jnp.full((seqs,), context, jnp.int32)
    x = jnp.asarray(rng.standard_normal((seqs, HIDDEN), np.float32))
    return x, pool, kv_lens, tables


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
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    lp = weights(rng)
    check = case(lp, 2, 40, rng)
    np.testing.assert_allclose(absorbed(lp, *check), expanded(lp, *check), rtol=1e-4, atol=1e-4)
    rows = []
    print(f"{'seqs':>5} {'context':>8} {'absorbed ms':>12} {'expanded ms':>12} {'ratio':>6}")
    for context in a.contexts:
        for seqs in a.seqs:
            args = (lp, *case(lp, seqs, context, rng))
            t_abs, t_exp = timed(absorbed, args, a.reps), timed(expanded, args, a.reps)
            rows.append(dict(seqs=seqs, context=context, absorbed_ms=t_abs * 1e3, expanded_ms=t_exp * 1e3))
            print(f"{seqs:>5} {context:>8} {t_abs * 1e3:>12.2f} {t_exp * 1e3:>12.2f} {t_exp / t_abs:>6.1f}", flush=True)
            del args
    print("RESULT " + json.dumps({"backend": jax.default_backend(), "device": str(jax.devices()[0]), "rows": rows}))


if __name__ == "__main__":
    main()
