"""The whole engine on a GPU with random weights: offline throughput, and greedy agreement
between the Pallas and the XLA attention backends.

Random weights because the lent GPU machine reaches no hub and its working tree is capped
at 64 MiB (the default model's GGUF is 98 MB): throughput depends on shapes, not values.
Prompts are random token ids with log-normal lengths (sigma 0.7), greedy, ignore_eos, all at t=0.
Workloads (--workloads, run in order in one process after one warm-up):
    custom        --num-prompts, --input-median, --output-median (prompts 16-1024, outputs 16-512)
    first256      the first H200 run's: 256 requests, medians 128/128 (the same clips)
    sharegpt1000  1,000 requests, ShareGPT-like medians 200/200 (prompts 16-1024, outputs 16-1024)
    batching      `jaxserve bench batching`'s continuous vs static batching on first256's requests

  python scripts/gpu_engine.py --model smollm2-135m --backend pallas --out /tmp/x
  python scripts/gpu_engine.py --model llama-3.1-8b --workloads sharegpt1000 first256
  python scripts/gpu_engine.py --model tiny --backend xla --num-prompts 8   # CPU smoke
Prints a line per phase, the warm-up's compile breakdown, one JSON line (tagged RESULT) and a
BRIEF line per workload; with --out, saves the custom workload's greedy tokens for
`--compare A.npz B.npz`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

SHAPES = {  # the Llama shapes a user would serve; rope and vocab as in their config.json
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                         rms_norm_eps=1e-5),
}


def random_model(name: str, dtype: str, seed: int = 0):
    import jax
    import jax.numpy as jnp

    from jaxserve.models import llama
    from jaxserve.models.config import ModelConfig
    from jaxserve.weights.loader import LoadedModel

    cfg = ModelConfig(architecture="LlamaForCausalLM", max_position_embeddings=4096, **SHAPES[name])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(llama.param_shapes(cfg),
                                                           is_leaf=lambda x: isinstance(x, tuple))
    dt = jnp.dtype(dtype)

    # Made on the device, one jitted program per leaf (an 8B model is 16 GB: never via the host).
    # Norms near 1, weights scaled so activations stay O(1) and logits are far from uniform.
    def make(key, shape, is_norm, fan_in):
        if is_norm:
            return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dt)
        return (jax.random.normal(key, shape, jnp.float32) * (1.5 / np.sqrt(fan_in))).astype(dt)

    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for key, (path, shape) in zip(keys, leaves):
        name_ = str(path[-1].key)
        fan_in = shape[-2] if len(shape) > 1 and name_ != "embed" else 64
        out.append(jax.jit(make, static_argnums=(1, 2, 3))(key, tuple(shape), "norm" in name_, fan_in))
    params = jax.tree.unflatten(treedef, out)
    jax.block_until_ready(params)
    return LoadedModel(cfg, params, None, f"random-{name}", Path("."))


def requests(num: int, vocab: int, seed: int, in_median: float, out_median: float, sigma: float = 0.7,
             out_max: int = 512):
    from jaxserve.bench.datasets import SampleRequest, lognormal_lengths

    rng = np.random.default_rng(seed)
    ins = lognormal_lengths(rng, num, in_median, sigma, 16, 1024)
    outs = lognormal_lengths(rng, num, out_median, sigma, 16, out_max)
    return [SampleRequest(rng.integers(0, vocab, n).tolist(), n, m) for n, m in zip(ins, outs)]


WORKLOADS = {"first256": (256, 128, 128, 512), "sharegpt1000": (1000, 200, 200, 1024)}  # n, medians, out max


class CompileTimes:
    """Sums JAX's compile events (monitoring listeners): what a warm-up's time went to."""

    EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace", "/jax/core/compile/jaxpr_to_mlir_module_duration":
              "lower", "/jax/core/compile/backend_compile_duration": "compile",
              "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read"}

    def __init__(self) -> None:
        from jax import monitoring

        self.secs = dict.fromkeys(self.EVENTS.values(), 0.0)
        self.count = dict.fromkeys(self.EVENTS.values(), 0)
        monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **kwargs) -> None:
        if event in self.EVENTS:
            self.secs[self.EVENTS[event]] += duration
            self.count[self.EVENTS[event]] += 1

    def brief(self) -> str:
        return ", ".join(f"{k} {self.secs[k]:.1f} s ({self.count[k]})" for k in self.secs)


def engine_kwargs(args) -> dict:
    from jaxserve.engine.args import ATTENTION_BACKENDS, EngineArgs

    if args.backend == "pallas-interpret":  # CPU smoke of the Pallas engine path (the kernels interpreted)
        from jaxserve.engine import llm_engine
        from jaxserve.models.attention import PALLAS_INTERPRET

        llm_engine.resolve_backend = lambda name: PALLAS_INTERPRET
        args.backend = "pallas"
    # "xla" and "reference" name the same backend (it is being renamed): pass whichever exists.
    backend = args.backend if args.backend in ATTENTION_BACKENDS else ({"xla": "reference", "reference": "xla"}
                                                                      .get(args.backend, args.backend))
    kw = dict(dtype=args.dtype, attention_backend=backend, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_chunked_prefill=True,
              enable_prefix_caching=False, compilation_cache_dir=args.compilation_cache_dir,
              # The GPU's defaults, spelled out: a CPU smoke run (pallas-interpret) then runs the
              # configuration the GPU will, not the CPU's 64-token blocks and bfloat16 pool.
              block_size=16, kv_cache_dtype="auto")
    if args.num_gpu_blocks:
        kw["num_gpu_blocks_override"] = args.num_gpu_blocks
    if args.quantization:  # quantize-on-load of the random float weights (fp8: e4m3 per channel)
        kw["quantization"] = args.quantization
    if args.async_scheduling is not None:
        if "async_scheduling" in EngineArgs.field_names():
            kw["async_scheduling"] = args.async_scheduling
        else:
            print("async_scheduling: not an engine argument in this tree, flag ignored", flush=True)
    return kw


def run(args) -> list[dict]:
    import jax

    if args.highest_precision:
        jax.config.update("jax_default_matmul_precision", "highest")
    from jaxserve.bench.throughput import run_throughput
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.worker.model_runner import num_compilations

    times = CompileTimes()
    t0 = time.perf_counter()
    model = random_model(args.model, args.dtype)
    init_s = time.perf_counter() - t0
    print(f"weights made in {init_s:.1f} s", flush=True)
    kw = engine_kwargs(args)
    t0 = time.perf_counter()
    llm = LLM(model, progress=False, **kw)
    eng = llm.llm_engine
    # Progress as it happens: a stage killed at its time limit still says how far it got.
    print(f"engine ready in {time.perf_counter() - t0:.1f} s: warm-up {eng.warmup_seconds:.1f} s "
          f"[{times.brief()}], {eng.num_gpu_blocks} KV blocks", flush=True)
    vocab = model.config.vocab_size
    common = dict(model=args.model, backend=kw["attention_backend"], dtype=args.dtype, quantization=args.quantization,
                  device=jax.devices()[0].device_kind, jax=jax.__version__, init_weights_s=round(init_s, 1),
                  warmup_s=round(eng.warmup_seconds, 1), warmup_compile=dict(times.secs),
                  num_gpu_blocks=eng.num_gpu_blocks, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=kw.get("async_scheduling"))
    run_throughput(llm, requests(8, vocab, args.seed + 1, 64, 16), progress=False)  # first steps off the clock
    print("first 8 requests done", flush=True)
    results = []
    for name in args.workloads:
        compiles = num_compilations()
        if name == "custom":
            reqs = requests(args.num_prompts, vocab, args.seed, args.input_median, args.output_median)
        else:
            reqs = _workload(name, vocab, args.seed)
        if name == "batching":
            from jaxserve.bench.batching import run_batching

            res = run_batching(eng, reqs, args.max_num_seqs, progress=False)
            res = {k: v for k, v in res.items() if k != "workload"}
        else:
            res = run_throughput(llm, reqs, progress=False)
        res.update(common, workload=name, compilations_during_run=num_compilations() - compiles,
                   num_compilations_after_warmup=eng.get_stats().num_compilations_after_warmup)
        print(f"{name}: {len(reqs)} requests done", flush=True)
        if name == "custom" and args.out:
            outs = llm.generate([{"prompt_token_ids": r.prompt} for r in reqs[:args.num_compare]],
                                _greedy(reqs[:args.num_compare]), use_tqdm=False)
            toks = [o.outputs[0].token_ids for o in outs]
            res["tokens_sha1"] = hashlib.sha1(json.dumps(toks).encode()).hexdigest()[:12]
            np.savez(args.out, *[np.asarray(t, np.int32) for t in toks])
        print("RESULT " + json.dumps(res), flush=True)
        print("BRIEF " + brief(res), flush=True)
        results.append(res)
    return results


def _workload(name: str, vocab: int, seed: int):
    n, in_median, out_median, out_max = WORKLOADS["first256" if name == "batching" else name]
    return requests(n, vocab, seed, in_median, out_median, out_max=out_max)


def _greedy(reqs):
    from jaxserve.core.sampling_params import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True) for r in reqs]


def compare(a: str, b: str) -> dict:
    """How many greedy sequences agree, and where the others first diverge."""
    x, y = np.load(a), np.load(b)
    same, first = 0, []
    for k in x.files:
        s, t = x[k], y[k]
        n = min(len(s), len(t))
        diff = np.nonzero(s[:n] != t[:n])[0]
        if len(diff) == 0 and len(s) == len(t):
            same += 1
        else:
            first.append(int(diff[0]) if len(diff) else n)
    return {"compare": [a, b], "identical": same, "of": len(x.files),
            "first_divergence_median": float(np.median(first)) if first else None,
            "tokens_per_sequence_median": float(np.median([len(x[k]) for k in x.files]))}


def brief(res: dict) -> str:
    if "compare" in res:
        return (f"greedy sequences identical {res['identical']}/{res['of']}, first divergence at token "
                f"{res['first_divergence_median']} (median) of {res['tokens_per_sequence_median']}")
    head = (f"{res['model']} {res['dtype']}{' ' + res['quantization'] if res.get('quantization') else ''} "
            f"{res['backend']} {res['workload']}"
            + ("" if res.get("async_scheduling") is None else f" async={res['async_scheduling']}") + ": ")
    c = res["warmup_compile"]
    tail = (f"; warm-up {res['warmup_s']} s (compile {c['compile']:.1f} s, trace+lower {c['trace'] + c['lower']:.1f} s, "
            f"cache reads {c['cache_read']:.1f} s), {res['num_gpu_blocks']} blocks, {res['compilations_during_run']} "
            f"compiles in the run, {res['num_compilations_after_warmup']} after warm-up")
    if res["workload"] == "batching":
        return head + (f"continuous/static {res['speedup_continuous_over_static']:.2f}x, /static-padded "
                       f"{res['speedup_continuous_over_static_padded']:.2f}x, continuous "
                       f"{res['continuous']['output_tokens_per_second']:.0f} output tok/s" + tail)
    return head + (f"{res['output_tokens_per_second']:.0f} output tok/s, {res['tokens_per_second']:.0f} total "
                   f"tok/s, {res['elapsed_time']:.2f} s for {res['num_requests']} requests, TTFT p50 "
                   f"{res['p50_ttft_ms']:.0f} ms" + tail)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--backend", choices=["pallas", "xla", "reference", "pallas-interpret"], default="pallas")
    p.add_argument("--workloads", nargs="+", default=["custom"], choices=["custom", "batching", *WORKLOADS])
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="passed to the engine when it has the argument (default: the engine's default)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, help="e.g. fp8: the weights quantized on load")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-median", type=float, default=128)
    p.add_argument("--output-median", type=float, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--compilation-cache-dir", default="~/.cache/jaxserve/xla", help="'' for none")
    p.add_argument("--highest-precision", action="store_true", help="float32 matmuls without TF32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="save the first --num-compare requests' greedy tokens here (.npz)")
    p.add_argument("--num-compare", type=int, default=64)
    p.add_argument("--compare", nargs=2, metavar="NPZ")
    args = p.parse_args()
    if args.compare:
        res = compare(*args.compare)
        print("RESULT " + json.dumps(res), flush=True)
        print("BRIEF " + brief(res), flush=True)
        return 0 if res["identical"] == res["of"] else 1
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
