"""Load time of the default model: from its GGUF vs from its `jaxserve convert` Orbax checkpoint.

Each load runs in a fresh Python process (nothing cached in memory: no compiled code, no open
files), timed from just before `load_model` to `block_until_ready` on every param, tokenizer
included (CPU s: the process's user + system time over the same span, which busy neighbours
disturb less than wall time); the interpreter and `import jax` are the same for both and are reported apart. Runs
alternate between the two sources after one untimed warm-up of each, so both read from the OS
page cache and a noisy neighbour hurts both alike. Median of --repeats.

    .venv/bin/python scripts/bench_load.py [--checkpoint DIR] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
def cpu():  # user + system seconds of all this process's threads: less sensitive to busy neighbours
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0 = time.perf_counter()
import jax
from jaxserve.weights.loader import load_model
t1, c1 = time.perf_counter(), cpu()
m = load_model(sys.argv[1], dtype=sys.argv[2], progress=False)
jax.block_until_ready(m.params)
t2, c2 = time.perf_counter(), cpu()
assert m.tokenizer is not None
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "cpu_s": c2 - c1}))
"""


def load_once(model: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, dtype], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def dir_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="an existing `jaxserve convert` output (default: convert to a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from jaxserve.weights.loader import default_model_path

    gguf = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "ckpt"
        if not args.checkpoint:
            subprocess.run([sys.executable, "-m", "jaxserve.cli", "convert", str(gguf), str(ckpt),
                            "--dtype", args.dtype], check=True, capture_output=True)
        sources = {"gguf": str(gguf), "orbax": str(ckpt)}
        runs: dict[str, list[dict]] = {k: [] for k in sources}
        for src in sources.values():  # warm-up: page cache, the GGUF's tokenizer cache
            load_once(src, args.dtype)
        for _ in range(args.repeats):
            for name, src in sources.items():
                runs[name].append(load_once(src, args.dtype))
        sizes = {name: dir_size(Path(src)) for name, src in sources.items()}

    print(f"default model {gguf.name}, dtype {args.dtype}, median of {args.repeats} fresh processes")
    print(f"{'source':<8}{'on disk':>10}{'load s (median)':>17}{'min':>8}{'max':>8}{'CPU s':>8}{'import s':>10}")
    med = {}
    for name, rs in runs.items():
        loads = [r["load_s"] for r in rs]
        med[name] = statistics.median(loads)
        print(f"{name:<8}{sizes[name] / 2**20:>8.0f}MB{med[name]:>17.2f}{min(loads):>8.2f}{max(loads):>8.2f}"
              f"{statistics.median(r['cpu_s'] for r in rs):>8.2f}{statistics.median(r['import_s'] for r in rs):>10.2f}")
    print(f"orbax / gguf: {med['orbax'] / med['gguf']:.2f}x the time ({med['gguf'] / med['orbax']:.1f}x faster)")
    return 0 if med["orbax"] < med["gguf"] else 1


if __name__ == "__main__":
    sys.exit(main())
