"""Run in a subprocess with 4 forced CPU devices: data parallel 2 x tensor parallel 2, then
data parallel 2 x pipeline parallel 2, behind the HTTP server, against a single-device engine on the same
weights. Prints one JSON line.

    python -m tests.dp_worker MODEL_DIR        -> {"tp": {...}, "pp": {...}}
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import asyncio  # noqa: E402
import json  # noqa: E402

import httpx  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.engine.args import EngineArgs  # noqa: E402
from jaxserve.engine.async_llm import DataParallelAsyncLLM  # noqa: E402
from jaxserve.entrypoints.openai.api_server import build_app  # noqa: E402
from jaxserve.weights.loader import load_model  # noqa: E402
from tests.fake_engine import serve_in_thread  # noqa: E402

ENGINE = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=64,
              block_size=8, dtype="float32")
PROMPTS = [[(7 * i + j) % 1000 + 10 for j in range(3 + i)] for i in range(12)]


async def hit(base: str, model: str) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def one(p):
            r = await client.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": 6,
                                                           "temperature": 0, "ignore_eos": True, "logprobs": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]
        return await asyncio.gather(*(one(p) for p in PROMPTS))


def main(model_dir: str) -> None:
    model = load_model(model_dir, "float32", progress=False)
    ref = LLM(model, progress=False, **ENGINE).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                                        use_tqdm=False)
    results = {}
    for layout, split in (("tp", dict(tensor_parallel_size=2)), ("pp", dict(pipeline_parallel_size=2))):
        dp = DataParallelAsyncLLM.from_engine_args(
            EngineArgs(model=model_dir, data_parallel_size=2, **split, **ENGINE), model=model, progress=False)
        with serve_in_thread(build_app(dp)) as base:
            texts = asyncio.run(hit(base, dp.model_name))
        devices = [sorted(d.id for m in ([r.engine.mesh] if layout == "tp" else r.engine.pipeline.meshes)
                          for d in m.devices.flat) for r in dp.replicas]
        results[layout] = {"match": [t == r.outputs[0].text for t, r in zip(texts, ref)], "served": dp.num_served,
                           "devices": devices,
                           "compiles_after_warmup": dp.get_stats().num_compilations_after_warmup}
        dp.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
