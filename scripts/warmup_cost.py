"""What a warm-up compiles, and what each program costs: the runner's program grid for an engine
configuration, with each program's trace + lower time (JAX's side, paid again on a restart that
loads the executables from the persistent cache) and, when the target platform is this machine's,
its XLA compile time.

  python scripts/warmup_cost.py --model llama-3.1-8b --platform cuda     # on a CPU: trace+lower only
  python scripts/warmup_cost.py --model llama-3.1-8b                      # on a GPU: + XLA compile
Parameters are ShapeDtypeStructs (nothing is allocated but a 2-block pool's shape). Prints one
line per program kind and a BRIEF line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from scripts.gpu_engine import SHAPES  # noqa: E402


def programs(cfg, backend: str, max_num_seqs: int, max_tokens: int, max_model_len: int, dtype, old_grid: bool):
    """(kind, jitted, args, kwargs) for every program ModelRunner.warmup compiles (old_grid: the grid
    of the first H200 run, before the Pallas backend had its own; no decode-only programs)."""
    from jaxserve.core.scheduler_output import SchedulerOutput
    from jaxserve.models import llama
    from jaxserve.models.attention import kv_pool_dtype
    from jaxserve.sample.sampling_metadata import SamplingMetadata
    from jaxserve.worker import model_runner as mr
    from jaxserve.worker import input_batch as ib

    sds = lambda s, d=dtype: jax.ShapeDtypeStruct(s, d)  # noqa: E731
    params = jax.tree.map(sds, llama.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    pool = (cfg.num_layers, cfg.num_kv_heads, 2, 16, cfg.head_dim)
    kv = (sds(pool, kv_pool_dtype("auto", dtype, backend)),) * 2
    pallas = backend.startswith("pallas") and not old_grid
    tokens = (ib.pallas_token_buckets if pallas else ib.step_token_buckets)(max_tokens)
    decode = ib.pallas_decode_buckets(max_num_seqs, max_tokens) if pallas else []
    seqs = (ib.pallas_seq_buckets if pallas else ib.step_seq_buckets)(max_num_seqs)
    rows = np.zeros(seqs[-1], np.int32)
    blocks = -(-max_model_len // 16)
    out = []
    for t, d in [(t, False) for t in tokens] + [(t, True) for t in decode]:
        batch, _ = ib.pack(SchedulerOutput(), t, max_num_seqs, blocks, 16, decode_only=d)
        out.append((f"model_step{'[decode]' if d else ''}", mr._model_step, (params, kv, batch, rows, rows),
                    dict(cfg=cfg, backend=backend)))
    hidden = sds((seqs[-1], cfg.hidden_size))
    for s in seqs:
        for greedy in (True, False):
            for pen in (False, True):
                for top_f in ((False,) if greedy else (False, True)):
                    md = SamplingMetadata.dummy(s, max_model_len, all_greedy=greedy, use_penalties=pen,
                                                use_top_filters=top_f)
                    out.append((f"sample_step[{s}]", mr._sample_step, (params, hidden, md), {"num_rows": seqs[-1]}))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--backend", default="pallas")
    p.add_argument("--platform", default=None, help="lower for this platform (default: this machine's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--old-grid", action="store_true", help="the first H200 run's grid (15 + 36 programs)")
    p.add_argument("--limit", type=int, default=0, help="time only the first N programs of each kind")
    a = p.parse_args()
    from jaxserve.models.config import ModelConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", max_position_embeddings=4096, **SHAPES[a.model])
    here = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    platform = a.platform or here
    progs = programs(cfg, a.backend, a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len, jnp.dtype(a.dtype),
                     a.old_grid)
    lower_s, compile_s, count, seen = defaultdict(float), defaultdict(float), defaultdict(int), defaultdict(int)
    for kind, fn, args, kw in progs:
        key = kind.split("[")[0] + ("[decode]" if "decode" in kind else "")
        seen[key] += 1
        if a.limit and seen[key] > a.limit:
            continue
        t0 = time.perf_counter()
        lowered = fn.trace(*args, **kw).lower(lowering_platforms=(platform,))
        lower_s[key] += time.perf_counter() - t0
        if platform == here:
            t0 = time.perf_counter()
            lowered.compile()
            compile_s[key] += time.perf_counter() - t0
        count[key] += 1
    print(f"{a.model} {a.dtype} backend={a.backend} lowered for {platform} on {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}")
    for key in seen:
        n = max(count[key], 1)
        print(f"{key:<20} programs {seen[key]:>3}  timed {count[key]:>3}  trace+lower {lower_s[key] / n:6.2f} s each"
              + (f"  compile {compile_s[key] / n:6.2f} s each" if compile_s else ""))
    compiled = bool(compile_s)
    est = sum(seen[k] * (lower_s[k] + compile_s[k]) / max(count[k], 1) for k in seen)
    print(f"BRIEF {len(progs)} programs; est. trace+lower{'+compile' if compiled else ''} {est:.1f} s "
          f"({', '.join(f'{k} x{seen[k]}' for k in seen)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
