"""Pipeline-parallel checks for tests/test_pipeline.py, run in a subprocess with 8 fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8), one JSON line of results.

    python -m tests.pipeline_worker tiny          # tiny models: greedy tokens per (tp, pp), bytes per device
    python -m tests.pipeline_worker default 4     # the default model (30 layers) at PP 4, TP 1
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.config import ModelConfig
from jaxserve.weights.loader import LoadedModel
from jaxserve.worker import sizing
from tests.parallel_worker import BASE, FAMILIES, random_params

NUM_LAYERS = 7  # uneven at PP 2, 3 and 4: stages 4|3, 2|3|2, 1|2|2|2
# (tp, pp, async scheduling: P steps in flight, disjoint requests)
# PP 2, 3 and 4, TP 1 and 2, the Llama, Qwen2 and Mistral layouts, async scheduling: each once (suite time).
PARALLEL = {"llama_gqa": [(1, 4, False), (2, 3, False), (1, 2, True)],
            "qwen2_bias_tied": [(2, 2, False)],
            "mistral_sliding": [(1, 3, True)]}
# the cases whose engines warm up (TP x PP, and async stages over sliding-window layers) and hold 0
# compilations after it; the others compile only what they run
WARMED = {"llama_gqa/tp2/pp3", "mistral_sliding/tp1/pp3/async"}
PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 250, 11], [8], [200, 3, 77, 9, 64]]
MAX_TOKENS = 8


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(prompts))]


def engine_for(model: LoadedModel, tp: int, pp: int, **kw) -> LLMEngine:
    # block size and a float32 pool given explicitly (not the CPU defaults): the byte counts below assume them
    kw = {"kv_cache_memory": 1 << 20, "block_size": 16, "kv_cache_dtype": "auto", **kw}
    args = EngineArgs(tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=64, max_num_seqs=2,
                      max_num_batched_tokens=16, compilation_cache_dir="", **kw)
    return LLMEngine(args, model=model, progress=False)


def device_bytes(engine: LLMEngine) -> dict[str, dict[int, int]]:
    """Bytes each device holds of the stages' params and of the KV pools."""
    out: dict[str, dict[int, int]] = {"weights": {}, "kv": {}}
    for key, tree in (("weights", engine.pipeline.params), ("kv", engine.runner.kv)):
        for x in jax.tree.leaves(tree):
            for shard in x.addressable_shards:
                out[key][shard.device.id] = out[key].get(shard.device.id, 0) + shard.data.nbytes
    return out


def check_tiny() -> dict:
    results = {}
    for name, settings in PARALLEL.items():
        cfg = ModelConfig(**{**BASE, **FAMILIES[name], "num_layers": NUM_LAYERS})
        model = LoadedModel(cfg, jax.tree.map(jnp.asarray, random_params(cfg)), None, name, Path("."))
        reference = greedy(engine_for(model, 1, 1, enforce_eager=True), PROMPTS)  # compiles only what it runs
        for tp, pp, overlap in settings:
            case = f"{name}/tp{tp}/pp{pp}" + ("/async" if overlap else "")
            engine = engine_for(model, tp, pp, async_scheduling=overlap, enforce_eager=case not in WARMED)
            tokens = greedy(engine, PROMPTS)
            ranges = sizing.stage_layer_ranges(cfg.num_layers, pp)
            held = device_bytes(engine)
            expect_w = {s * tp + d: sizing.stage_weight_bytes(cfg, 4, tp, s, pp)
                        for s in range(pp) for d in range(tp)}
            per_block = sizing.kv_heads_per_device(cfg, tp) * engine.block_size * cfg.head_dim * 4 * 2
            expect_kv = {s * tp + d: per_block * (b - a) * engine.num_gpu_blocks
                         for s, (a, b) in enumerate(ranges) for d in range(tp)}
            results[case] = dict(
                equal=tokens == reference, tokens=tokens, reference=reference,
                warmed=case in WARMED, compiles_after_warmup=engine.get_stats().num_compilations_after_warmup,
                weights=held["weights"] == expect_w, kv=held["kv"] == expect_kv,
                held=held, expect_weights=expect_w, expect_kv=expect_kv)
    return results


def check_default(pp: int) -> dict:
    from jaxserve.weights.loader import load_model
    model = load_model(None, "float32", progress=False)
    ids = [1, 504, 3458, 282, 4649, 314]  # any ids of its 49152-token vocabulary
    # one request: both engines compile only what it runs (the tiny models' cases hold the warm-up)
    reference = greedy(engine_for(model, 1, 1, kv_cache_memory=64 << 20, enforce_eager=True), [ids])
    tokens = greedy(engine_for(model, 1, pp, kv_cache_memory=64 << 20, enforce_eager=True), [ids])
    return {f"default/pp{pp}": dict(equal=tokens == reference, tokens=tokens, reference=reference)}


if __name__ == "__main__":
    what = sys.argv[1]
    result = check_tiny() if what == "tiny" else check_default(int(sys.argv[2]))
    print(json.dumps(result, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))
