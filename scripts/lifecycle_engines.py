"""Build, use and drop N engines of different configurations in one process (a tiny random model),
printing memory maps and live memory after each: both should stay flat after the first few.
tests/test_lifecycle.py runs the same loop with 8 engines; this is the issue's 50.

    python scripts/lifecycle_engines.py [--num-engines 50] [--keep-programs]

--keep-programs reproduces the old behaviour for comparison (every engine's executables kept alive
by a reference, as JAX's caches kept the shared module-level programs'): maps grow by thousands an
engine, and past vm.max_map_count (65,530) the process crashes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.engine.args import EngineArgs  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.models.config import ModelConfig  # noqa: E402
from jaxserve.weights.loader import LoadedModel  # noqa: E402
from tests.parallel_worker import BASE, random_params  # noqa: E402
from tests.test_lifecycle import COMMON, GREEDY, num_memory_maps, rss_mib  # noqa: E402


def config(i: int) -> dict:
    """Engine i's settings: block size, sequence and token limits and pool size all vary."""
    return dict(block_size=(8, 16, 32)[i % 3], max_num_seqs=(1, 2, 4)[i // 3 % 3],
                max_num_batched_tokens=(8, 16)[i // 9 % 2], num_gpu_blocks_override=16 + i)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-engines", type=int, default=50)
    p.add_argument("--keep-programs", action="store_true")
    a = p.parse_args()
    cfg = ModelConfig(**BASE)
    model = LoadedModel(cfg, jax.tree.map(jnp.asarray, random_params(cfg)), None, "random-tiny", Path("."))
    kept = []  # --keep-programs: every engine's StepPrograms, never released
    if a.keep_programs:
        from jaxserve.worker.programs import StepPrograms

        StepPrograms.release = lambda self: None
    start = time.perf_counter()
    for i in range(a.num_engines):
        t0 = time.perf_counter()
        engine = LLMEngine(EngineArgs(**COMMON, **config(i)), model=model, progress=False)
        engine.add_request("r", [5, 17, 3, 99], GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        if a.keep_programs:
            kept.append(engine.runner.programs)
        engine.shutdown()
        del engine
        gc.collect()
        print(f"engine {i:3d} {config(i)}: {time.perf_counter() - t0:5.1f} s, {num_memory_maps():6d} maps, "
              f"{rss_mib():7.0f} MiB live", flush=True)
    print(f"{a.num_engines} engines in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
