"""Start-up memory of an engine: `LLM(model, dtype=D)` in a fresh process per dtype, reporting the
process's resident memory after start-up (weights, KV pool, compiled programs), its peak during
start-up (ru_maxrss: what the host must have free), the start-up seconds and the engine's weights
figure. Used for the CPU default's bfloat16 MoE experts (BENCHMARKS.md).

    .venv/bin/python scripts/startup_memory.py --model /tmp/qwen3moe-peer [--dtypes auto float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from jaxserve import LLM
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], speculative_config={})
started = time.perf_counter() - t0
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1e6
print(json.dumps({"dtype": sys.argv[2], "resident_gb": round(rss, 2),
                  "peak_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
                  "start_s": round(started, 1), "weights_mib": round(llm.llm_engine.weight_bytes / 2**20, 1)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtypes", nargs="+", default=["auto", "float32"])
    args = p.parse_args()
    print("| --dtype | resident after start-up GB | peak GB | start-up s | weights figure MiB |")
    print("|---|---:|---:|---:|---:|")
    for dtype in args.dtypes:
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, dtype], capture_output=True, text=True,
                             check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {dtype} | {r['resident_gb']} | {r['peak_gb']} | {r['start_s']} | {r['weights_mib']} |")


if __name__ == "__main__":
    main()
