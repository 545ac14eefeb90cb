"""How long rank 0 takes to hand one step to another host, three ways, at 1, 64 and 256 sequences:

    typed   host_channel's typed arrays through jax.distributed's key-value store (what multihost.py uses)
    pickle  the old channel: zlib'd pickle through the same store
    bcast   jax.experimental.multihost_utils.broadcast_one_to_all of the step's arrays (a collective;
            the receiver must already know every shape, so this is a lower bound for that design)

Two processes on 127.0.0.1 (one CPU device each, gloo); a decode step of N sequences shaped like a
max_model_len=2048, block_size=16, max_num_seqs=256 server's (block tables [256, 128], sampling rows
padded to N's bucket). For typed/pickle the time is send -> rank 1 decoded -> ack seen by rank 0,
so it includes one extra store round trip; for bcast the collective's time on rank 0.

    python scripts/bench_host_channel.py [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

SIZES = (1, 64, 256)
MAX_NUM_SEQS, MAX_MODEL_LEN, BLOCK_SIZE = 256, 2048, 16


def make_step(n: int):
    import numpy as np

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.models.attention import AttentionMetadata
    from jaxserve.sample.sampling_metadata import RowInfo, SamplingMetadata
    from jaxserve.worker.input_batch import StepInput, bucket_for, step_seq_buckets, step_token_buckets
    from jaxserve.worker.model_runner import PreparedStep

    t = bucket_for(n, step_token_buckets(MAX_NUM_SEQS))
    s = bucket_for(n, step_seq_buckets(MAX_NUM_SEQS))
    rng = np.random.default_rng(n)
    blocks = MAX_MODEL_LEN // BLOCK_SIZE
    tables = np.zeros((MAX_NUM_SEQS, blocks), np.int32)
    tables[:n, :40] = rng.integers(0, 20000, (n, 40))
    attn = AttentionMetadata(slot_mapping=rng.integers(0, 10**6, t).astype(np.int32),
                             kv_lens=np.full(MAX_NUM_SEQS, 600, np.int32), block_tables=tables,
                             cu_q_lens=np.arange(MAX_NUM_SEQS + 1, dtype=np.int32), num_seqs=np.array([n], np.int32),
                             decode_only=True)
    batch = StepInput(token_ids=rng.integers(0, 49152, t).astype(np.int32), positions=np.full(t, 600, np.int32),
                      prev_rows=np.arange(t, dtype=np.int32), attn=attn)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    md = SamplingMetadata.build_host([RowInfo(params, i, 100, [1] * 500, [2] * 100, ()) for i in range(n)], s,
                                     MAX_MODEL_LEN, None, 49152 // 32)
    return PreparedStep(batch=batch, rows=np.arange(s, dtype=np.int32), sampling=md,
                        sample_ids=[(f"cmpl-{i:032x}-0", 0, 0) for i in range(n)])


def rank_main(rank: int, port: int, reps: int) -> None:
    import pickle
    import zlib

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank)
    from jaxserve.engine.multihost import CODEC, _client

    client = _client()
    codecs = {"typed": (CODEC.encode, CODEC.decode),
              "pickle": (lambda m: zlib.compress(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL), 1),
                         lambda d: pickle.loads(zlib.decompress(d)))}
    results = {}
    for n in SIZES:
        step = make_step(n)
        for name, (enc, dec) in codecs.items():
            times = []
            for i in range(reps + 2):
                key, ack = f"b/{name}/{n}/{i}", f"b/ack/{name}/{n}/{i}"
                if rank == 0:
                    t0 = time.perf_counter()
                    client.key_value_set_bytes(key, enc(step))
                    client.blocking_key_value_get(ack, 60_000)
                    times.append(time.perf_counter() - t0)
                else:
                    dec(client.blocking_key_value_get_bytes(key, 60_000))
                    client.key_value_delete(key)
                    client.key_value_set(ack, "1")
            results[f"{name}/{n}"] = dict(ms=1e3 * float(np.median(times[2:])) if times else None,
                                          bytes=len(enc(step)))
        leaves = [np.asarray(x) for x in jax.tree.leaves((step.batch, step.rows, step.sampling))]
        tree = leaves if rank == 0 else [np.zeros_like(x) for x in leaves]
        times = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            multihost_utils.broadcast_one_to_all(tree)
            times.append(time.perf_counter() - t0)
        results[f"bcast/{n}"] = dict(ms=1e3 * float(np.median(times[2:])), bytes=sum(x.nbytes for x in leaves))
    if rank == 0:
        print(json.dumps(results))
    jax.distributed.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank is not None:
        return rank_main(a.rank, a.port, a.reps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--reps", str(a.reps)],
                              env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = procs[0].communicate(timeout=900)[0]
    procs[1].wait(60)
    results = json.loads(out.strip().splitlines()[-1])
    print(f"{'per step':10s}" + "".join(f"{n:>22d}" for n in SIZES) + "   (ms, message bytes)")
    for name in ("typed", "pickle", "bcast"):
        cells = "".join(f"{results[f'{name}/{n}']['ms']:>12.2f} {results[f'{name}/{n}']['bytes']:>9d}" for n in SIZES)
        print(f"{name:10s}{cells}")


if __name__ == "__main__":
    main()
