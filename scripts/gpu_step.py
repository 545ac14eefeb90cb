"""One decode step against the hardware: the model step (and model + sampler) at batch B with
contexts of C tokens, timed against (weight bytes + KV bytes read) / a measured copy bandwidth;
and the in-place check of the KV pool on the program actually compiled for this device.

  python scripts/gpu_step.py --model llama-3.1-8b --batches 256 1 --context 1024
  python scripts/gpu_step.py --model tiny --batches 4 1 --context 64 --reps 2    # CPU smoke
Per batch: the routed program (Pallas: the decode kernel) and, at the first batch, the same step
forced onto the ragged kernel. Random weights (throughput depends on shapes only). Prints one
BRIEF line per figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scripts.gpu_engine import random_model  # noqa: E402


def copy_bandwidth(num_bytes: int, reps: int) -> float:
    """GB/s of a device-to-device `x + 1` over num_bytes (read + write)."""
    import jax.numpy as jnp

    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    return 2 * num_bytes / timed(lambda: f(x), reps) / 1e9


def timed(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def decode_batch(batch: int, context: int, block_size: int, vocab: int):
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput

    per = -(-context // block_size)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(batch * per).reshape(batch, per)  # scattered, as a busy pool is
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    seqs = [ScheduledRequest(f"r{i}", [int(rng.integers(vocab))], context - 1, blocks[i].tolist(), True,
                             sampling_params=greedy, prompt_token_ids=[0] * (context - 1)) for i in range(batch)]
    return SchedulerOutput(seqs, batch)


def step_figures(model, backend: str, batch: int, context: int, copy_gbs: float, reps: int,
                 compare_ragged: bool) -> None:
    import jax.numpy as jnp

    from jaxserve.worker import hlo_checks
    from jaxserve.worker import model_runner as mr
    from jaxserve.worker.input_batch import pack

    cfg, bs = model.config, 16
    # At least 1024 blocks: a pool larger than any activation, so the memory-analysis check means something.
    rc = mr.RunnerConfig(num_blocks=max(1024, batch * -(-context // bs) + 1), block_size=bs, max_num_seqs=max(batch, 1),
                         max_num_batched_tokens=max(batch, 64), max_model_len=max(2048, context), backend=backend)
    runner = mr.ModelRunner(model, rc)
    out = decode_batch(batch, context, bs, cfg.vocab_size)
    prepared = runner.prepare(out)
    rows = jnp.asarray(prepared.rows)
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params)) - model.params["embed"].nbytes * (
        "lm_head" in model.params)  # the embedding table is read a row per token, unless it is the LM head
    kv_read = batch * context * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * runner.kv[0].dtype.itemsize
    ideal_ms = (weights + kv_read) / copy_gbs / 1e6
    pool = runner.kv[0].shape

    def model_only(batch_in):
        runner.kv, hidden, _ = runner._model_step(runner.params, runner.kv, batch_in, rows, runner._prev_tokens)
        return hidden

    variants = [("routed" if runner.decode_buckets else "xla", prepared.batch)]
    if compare_ragged and runner.decode_buckets:
        forced, _ = pack(out, prepared.batch.token_ids.shape[0], rc.max_num_seqs, rc.max_blocks_per_seq, bs,
                         decode_only=False)
        variants.append(("ragged", forced))
    for name, b in variants:
        dev = jax.device_put(b)
        compiled = mr._model_step.lower(runner.params, runner.kv, dev, rows, runner._prev_tokens, cfg=cfg,
                                        backend=backend).compile()
        problems = hlo_checks.compiled_problems(compiled, pool, runner.kv[0].dtype)
        print(f"BRIEF in-place KV pool, {name} model step B={batch}: "
              + ("OK (aliased, no pool-sized copy)" if not problems else "PROBLEMS " + "; ".join(problems[:4])),
              flush=True)
        t_model = timed(lambda: model_only(dev), reps)
        print(f"BRIEF decode step B={batch} ctx={context} {name}: model {t_model * 1e3:.2f} ms; ideal (weights "
              f"{weights / 1e9:.2f} GB + KV {kv_read / 1e9:.2f} GB)/copy {ideal_ms:.2f} ms -> "
              f"{t_model * 1e3 / ideal_ms:.2f}x", flush=True)
    t_step = timed(lambda: runner.run(prepared).sampled, reps)  # model + LM head + sampler + token fetch
    print(f"BRIEF decode step B={batch} ctx={context} model+sample+fetch {t_step * 1e3:.2f} ms -> "
          f"{t_step * 1e3 / ideal_ms:.2f}x ideal; {batch / t_step:.0f} tok/s at this batch", flush=True)
    del runner


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="pallas")
    p.add_argument("--batches", type=int, nargs="+", default=[256, 1])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    a = p.parse_args()
    copy_gbs = copy_bandwidth(a.copy_bytes, a.reps)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, copy {copy_gbs:.1f} GB/s", flush=True)
    model = random_model(a.model, a.dtype)
    for i, b in enumerate(a.batches):
        step_figures(model, a.backend, b, a.context, copy_gbs, a.reps, compare_ragged=i == 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
