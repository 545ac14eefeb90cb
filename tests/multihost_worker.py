"""One process of tests/test_multihost.py: a rank of a two-process jax.distributed run over gloo,
or the single-process reference. Writes one JSON file.

    python -m tests.multihost_worker reference MODEL_DIR OUT.json          (1 device, no mesh)
    python -m tests.multihost_worker rank MODEL_DIR OUT.json PORT RANK [pp] (2 processes: TP 2 over both,
                                                                            or with pp: PP 2, a stage each)

The pp runs preempt by recomputation (pipeline stages refuse swap), the others by swapping.

Rank 0 drives LLMEngine.step() itself (no HTTP); rank 1 follows with multihost.follow.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# A small pool so requests are preempted by swapping (exercises the host pool across processes);
# num_gpu_blocks_override keeps the block count, and so the schedule, the same at TP 1 and TP 2.
# float32 throughout (KV pool included): the served LoRA completions are held to peft's.
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=12,
              block_size=8, dtype="float32", kv_cache_dtype="auto", preemption_mode="swap", swap_space=0.01,
              compilation_cache_dir="")
# Pipeline stages: the same small pool, preempting by recomputation.
ENGINE_PP = {**ENGINE, "preemption_mode": "recompute", "swap_space": 0}
PROMPTS = [[(11 * i + 3 * j) % 900 + 20 for j in range(4 + 3 * i)] for i in range(6)]
MAX_TOKENS = 24
WORKER_TIMEOUT_S = 480  # a rank 1 that hears nothing from rank 0 for this long fails instead of hanging


def requests():
    from jaxserve.core.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    out = [(f"greedy-{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    out.append(("sampled", PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True)))
    out.append(("prompt-logprobs", PROMPTS[3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                              prompt_logprobs=2)))
    return out


def drive(engine) -> dict:
    """Every request at once through engine.step(); tokens, logprobs and prompt logprobs per request."""
    for rid, prompt, params in requests():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    results, steps, deadline = {}, 0, time.monotonic() + 600
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish in 600 s"
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                results[out.request_id] = dict(
                    tokens=c.token_ids, text=c.text,
                    logprobs=[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else None,
                    prompt_logprobs=[None if d is None else {str(k): v.logprob for k, v in d.items()}
                                     for d in (out.prompt_logprobs or [])])
        steps += 1
    stats = engine.get_stats()
    return dict(results=results, steps=steps, num_preemptions=stats.num_preemptions,
                compiles_after_warmup=stats.num_compilations_after_warmup)


def local_bytes(*trees) -> int:
    """Bytes of `trees` held on this process's devices."""
    import jax

    return sum(s.data.nbytes for t in trees for x in jax.tree.leaves(t) for s in x.addressable_shards)


class Planted:
    """What an attacker would plant in the store: unpickling it would create `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def planted(port: str, rank: str, out_path: str) -> None:
    """No engine: rank 0 writes a pickle (which, unpickled, creates a file) where rank 1's next step
    message goes, then a real typed stop message; rank 1 must refuse the first and not run it."""
    import pickle
    import zlib

    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine import multihost

    args = EngineArgs(num_hosts=2, host_rank=int(rank), coordinator=f"127.0.0.1:{port}")
    multihost.initialize(args)
    import jax

    marker = out_path + ".pwned"
    channel = multihost.StepChannel(timeout_s=60)
    result: dict = {}
    if multihost.is_leader():
        payload = pickle.dumps(Planted(marker))
        for data in (payload, zlib.compress(payload, 1)):  # raw, and framed like the old channel's messages
            channel.client.key_value_set_bytes(channel._key(1), data)
            channel.client.blocking_key_value_get(f"jaxserve/test/refused/{channel.seq}", 60_000)
            channel.seq += 1
        channel.send(None)
    else:
        errors = []
        for _ in range(2):
            try:
                channel.recv()
                errors.append(None)
            except ValueError as e:  # (the message was taken off the store before it was decoded)
                errors.append(str(e))
            channel.client.key_value_set(f"jaxserve/test/refused/{channel.seq - 1}", "1")
        result = dict(errors=errors, stop=channel.recv(), unpickled=os.path.exists(marker))
    leader = multihost.is_leader()
    multihost._stop_heartbeats()
    jax.distributed.shutdown()
    if not leader:  # (rank 1 reports)
        with open(out_path, "w") as f:
            json.dump(result, f)


KILLED_HEARTBEAT_S = 4.0  # the watchdog's timeout in the killed-rank run


def drive_until_failure(engine, out_path: str) -> None:
    """Rank 0 of the killed-rank run: serve requests without end (a file says when the steps flow)
    until a step fails; write what failed and when, then exit 1 (or the watchdog's exit)."""
    from jaxserve.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    n = 0
    try:
        while True:
            if not engine.has_unfinished_requests():
                for p in PROMPTS:
                    engine.add_request(f"r{n}", {"prompt_token_ids": p}, params)
                    n += 1
            engine.step()
            if not os.path.exists(out_path + ".serving"):
                open(out_path + ".serving", "w").close()
    except Exception as e:  # the failure the engine loop would turn into errors for its requests
        with open(out_path, "w") as f:
            json.dump(dict(error=f"{type(e).__name__}: {e}", failed_at=time.time(),
                           lost=engine.runner.lost), f)
    os._exit(1)  # (jax.distributed.shutdown would wait for the dead rank)


def main(argv: list[str]) -> None:
    if argv[0] == "planted":
        return planted(*argv[1:4])
    mode, model_dir, out_path = argv[:3]
    pp = mode == "rank" and argv[-1] == "pp"
    from jaxserve.engine.args import EngineArgs

    if mode == "reference":
        import jax

        from jaxserve.engine.llm_engine import LLMEngine

        # the reference compiles only what it runs (the ranks hold the warm-up)
        result = drive(LLMEngine(EngineArgs(model=model_dir, enforce_eager=True, **ENGINE), progress=False))
        result["num_devices"] = jax.device_count()
    else:
        port, rank = argv[3:5]
        from jaxserve.engine import multihost

        layout = dict(pipeline_parallel_size=2) if pp else dict(tensor_parallel_size=2)
        args = EngineArgs(model=model_dir, num_hosts=2, host_rank=int(rank), coordinator=f"127.0.0.1:{port}",
                          **layout, **(ENGINE_PP if pp else ENGINE))
        multihost.initialize(args)
        import jax

        if multihost.is_leader() and argv[-1] == "killed":
            drive_until_failure(multihost.leader_engine(args, progress=False,
                                                        heartbeat_timeout_s=KILLED_HEARTBEAT_S), out_path)
        if multihost.is_leader():
            engine = multihost.leader_engine(args, progress=False)
            try:
                result = drive(engine)
                result["steps_sent"] = engine.runner.num_steps_sent
            finally:
                multihost.stop_workers(engine)
        else:
            engine = multihost.worker_engine(args)
            result = dict(steps_run=multihost.follow(engine, timeout_s=WORKER_TIMEOUT_S),
                          compiles_after_warmup=engine.get_stats().num_compilations_after_warmup)
        result.update(process_count=jax.process_count(), num_devices=jax.device_count(),
                      local_devices=jax.local_device_count())
        if pp:  # what this process holds: its stage's layers and KV pool, nothing of the other stage
            result.update(stage_processes=[sorted({d.process_index for d in m.devices.flat})
                                           for m in engine.pipeline.meshes],
                          local_bytes=local_bytes(engine.pipeline.params, engine.runner.kv),
                          stage_bytes=[local_bytes(sp, engine.runner.kv[2 * s: 2 * s + 2])
                                       for s, sp in enumerate(engine.pipeline.params)])
        else:
            result.update(mesh_processes=sorted({d.process_index for d in engine.mesh.devices.flat}),
                          wq_shard=list(engine.model.params["layers"]["wq"].addressable_shards[0].data.shape),
                          wq_shape=list(engine.model.params["layers"]["wq"].shape))
        jax.distributed.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
