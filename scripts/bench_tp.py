"""Engine throughput at tensor parallel 1, 2 and 4 on CPU fake devices.

Each TP size runs in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the
same flags for all, so only the mesh differs), builds an LLMEngine (warm-up excluded from the
timing), then serves --num-requests prompts of --prompt-len random tokens, --output-len greedy
tokens each (ignore_eos), all submitted at once. Reported per TP size: output tokens/s over the
whole run, prefill tokens/s (steps that hold prompt tokens), decode step time and tokens/s (steps
where every request decodes one token), CPU seconds per output token (user + system of all
threads: the work, whatever the number of cores), and a hash of the greedy tokens (equal across
TP sizes when the sharded model computes the same thing).

    .venv/bin/python scripts/bench_tp.py [--model PATH] [--tp 1,2,4] [--num-requests 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import hashlib, json, resource, sys, time
import numpy as np
a = json.loads(sys.argv[1])
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.core.sampling_params import SamplingParams

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

t0 = time.perf_counter()
engine = LLMEngine(EngineArgs(model=a["model"], tensor_parallel_size=a["tp"], dtype="float32",
                              max_model_len=a["prompt_len"] + a["output_len"], max_num_seqs=a["num_requests"],
                              max_num_batched_tokens=max(256, a["prompt_len"]), compilation_cache_dir=""),
                   progress=False)
startup = time.perf_counter() - t0
rng = np.random.default_rng(0)
vocab = engine.model.config.vocab_size
params = SamplingParams(temperature=0, max_tokens=a["output_len"], ignore_eos=True)
for i in range(a["num_requests"]):
    engine.add_request(str(i), {"prompt_token_ids": rng.integers(0, vocab, a["prompt_len"]).tolist()}, params)
prefill_s = prefill_tokens = decode_s = decode_steps = 0
tokens = {}
c0, t0 = cpu(), time.perf_counter()
while engine.has_unfinished_requests():
    s0 = time.perf_counter()
    n_running = engine.scheduler.stats().num_running
    outs = engine.step()
    dt = time.perf_counter() - s0
    for o in outs:
        if o.finished:
            tokens[o.request_id] = o.outputs[0].token_ids
    stats = engine.get_stats()
    if stats.num_prompt_tokens > prefill_tokens:
        prefill_s += dt
        prefill_tokens = stats.num_prompt_tokens
    elif n_running == a["num_requests"]:
        decode_s += dt
        decode_steps += 1
wall, cpu_s = time.perf_counter() - t0, cpu() - c0
out_tokens = sum(len(t) for t in tokens.values())
digest = hashlib.sha1(json.dumps([tokens[k] for k in sorted(tokens, key=int)]).encode()).hexdigest()[:12]
print(json.dumps(dict(tp=a["tp"], startup_s=startup, wall_s=wall, output_tok_s=out_tokens / wall,
                      prefill_tok_s=prefill_tokens / max(prefill_s, 1e-9),
                      decode_step_ms=1e3 * decode_s / max(decode_steps, 1),
                      decode_tok_s=a["num_requests"] * decode_steps / max(decode_s, 1e-9),
                      cpu_s_per_token=cpu_s / out_tokens, tokens_sha=digest,
                      compiles_after_warmup=engine.get_stats().num_compilations_after_warmup)))
"""


def run(tp: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    spec = dict(model=args.model, tp=tp, num_requests=args.num_requests, prompt_len=args.prompt_len,
                output_len=args.output_len)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"TP {tp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tp", default="1,2,4", help="tensor parallel sizes, comma-separated")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    print(f"{os.cpu_count()} CPU cores; {args.num_requests} requests x ({args.prompt_len} prompt + "
          f"{args.output_len} output tokens), greedy, float32")
    print(f"{'TP':>3} {'output tok/s':>12} {'prefill tok/s':>13} {'decode ms/step':>14} {'decode tok/s':>12} "
          f"{'CPU s/token':>11} {'start-up s':>10}  tokens")
    base = None
    for tp in [int(t) for t in args.tp.split(",")]:
        r = run(tp, args)
        base = base or r["output_tok_s"]
        print(f"{tp:>3} {r['output_tok_s']:>12.1f} {r['prefill_tok_s']:>13.1f} {r['decode_step_ms']:>14.1f} "
              f"{r['decode_tok_s']:>12.1f} {r['cpu_s_per_token']:>11.4f} {r['startup_s']:>10.1f}  "
              f"{r['tokens_sha']} (x{r['output_tok_s'] / base:.2f} of TP {args.tp.split(',')[0]}, "
              f"{r['compiles_after_warmup']} compiles after warm-up)", flush=True)


if __name__ == "__main__":
    main()
