"""Run in a subprocess with 4 forced CPU devices: data parallel 2 x tensor parallel 2, then
data parallel 2 x pipeline parallel 2, behind the HTTP server, against a single-device engine on the same
weights. The tensor-parallel layout serves LoRA adapters too (pipeline stages refuse LoRA): one from
--lora-modules, two loaded at once over /v1/load_lora_adapter; their completions are returned for the
parent to check against peft. Prints one JSON line.

    python -m tests.dp_worker MODEL_DIR REFS.json   -> {"tp": {..., "lora": {...}}, "pp": {...}}
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the load/unload routes

import asyncio  # noqa: E402
import json  # noqa: E402

import httpx  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.engine.args import EngineArgs  # noqa: E402
from jaxserve.engine.async_llm import DataParallelAsyncLLM  # noqa: E402
from jaxserve.entrypoints.openai.api_server import build_app  # noqa: E402
from jaxserve.entrypoints.openai.serving_lora import register_lora_modules  # noqa: E402
from jaxserve.weights.loader import load_model  # noqa: E402
from tests.fake_engine import serve_in_thread  # noqa: E402
from tests.lora_helpers import http_lora_completions  # noqa: E402

# float32 throughout (KV pool included, no n-gram drafts): the LoRA completions are held to peft's
ENGINE = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=64,
              block_size=8, dtype="float32", kv_cache_dtype="auto", speculative_config={})
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=16)  # 3 adapters over 2 slots per replica
PROMPTS = [[(7 * i + j) % 1000 + 10 for j in range(3 + i)] for i in range(12)]


async def hit(base: str, model: str) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def one(p):
            r = await client.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": 6,
                                                           "temperature": 0, "ignore_eos": True, "logprobs": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]
        return await asyncio.gather(*(one(p) for p in PROMPTS))


async def load_two(base: str, refs: dict) -> list[int]:
    """all4 and mlp16rs loaded at once (the front's lock: one id each, on every replica)."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def one(name: str) -> int:
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": refs[name]["path"]})
            return r.status_code
        return list(await asyncio.gather(one("all4"), one("mlp16rs")))


def serve_lora(dp: DataParallelAsyncLLM, base: str, refs: dict) -> dict:
    """Adapters on every replica: loaded, used by requests spread over both, unloaded."""
    before = list(dp.num_served)
    status = asyncio.run(load_two(base, refs))
    names = ["qv8", "all4", "mlp16rs"]
    ids = {n: [r.lora_manager.resolve(n).lora_int_id for r in dp.replicas] for n in names}
    completions = http_lora_completions(base, names, refs["prompt_ids"])
    unload = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "all4"}).status_code
    after_unload = httpx.post(f"{base}/v1/completions", json={"model": "all4", "prompt": "x", "max_tokens": 1})
    return {"load_status": status, "ids": ids, "completions": completions,
            "served": [a - b for a, b in zip(dp.num_served, before)], "unload_status": unload,
            "unloaded_status": after_unload.status_code,
            "resolved_after_unload": [r.lora_manager.resolve("all4") is not None for r in dp.replicas]}


def main(model_dir: str, refs_path: str) -> None:
    refs = json.loads(open(refs_path).read())
    model = load_model(model_dir, "float32", progress=False)
    # the one-replica reference compiles only what it runs (the replicas hold the warm-up)
    ref = LLM(model, progress=False, enforce_eager=True, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False)
    results = {}
    for layout, split in (("tp", dict(tensor_parallel_size=2)), ("pp", dict(pipeline_parallel_size=2))):
        lora = LORA if layout == "tp" else {}
        # the pp layout's replicas compile only what they run (warm-up under DP: the tp layout; under PP:
        # tests/test_pipeline.py)
        eager = dict(enforce_eager=True) if layout == "pp" else {}
        dp = DataParallelAsyncLLM.from_engine_args(
            EngineArgs(model=model_dir, data_parallel_size=2, **split, **ENGINE, **lora, **eager), model=model,
            progress=False)
        if lora:
            register_lora_modules(dp, (f"qv8={refs['qv8']['path']}",))
        with serve_in_thread(build_app(dp)) as base:
            texts = asyncio.run(hit(base, dp.model_name))
            served = list(dp.num_served)
            lora_result = serve_lora(dp, base, refs) if lora else None
        devices = [sorted(d.id for m in ([r.engine.mesh] if layout == "tp" else r.engine.pipeline.meshes)
                          for d in m.devices.flat) for r in dp.replicas]
        results[layout] = {"match": [t == r.outputs[0].text for t, r in zip(texts, ref)], "served": served,
                           "devices": devices,
                           "compiles_after_warmup": dp.get_stats().num_compilations_after_warmup,
                           "lora": lora_result}
        dp.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
