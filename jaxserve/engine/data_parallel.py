"""Data parallelism: M independent engine replicas, each on its own (data=1, model=tp) slice
of the devices (with pipeline stages: its own run of tp x pp devices), behind one server. A request goes to the replica with the fewest requests in
flight and stays there; the replicas share nothing, so they need no collectives at all."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import fields

import jax

from jaxserve import parallel
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.worker.model_runner import num_compilations
from jaxserve.engine.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.stats import EngineStats
from jaxserve.weights.loader import LoadedModel, load_model


class DataParallelAsyncLLM:
    def __init__(self, replicas: list[AsyncLLM]) -> None:
        self.replicas = replicas
        first = replicas[0]
        self.tokenizer, self.max_model_len, self.model_name = first.tokenizer, first.max_model_len, first.model_name
        self.block_size = first.block_size
        self.in_flight = [0] * len(replicas)
        self.num_served = [0] * len(replicas)  # requests each replica has taken, for logs and tests
        self._owner: dict[str, int] = {}

    @classmethod
    def from_engine_args(cls, args: EngineArgs, model: LoadedModel | None = None,
                         progress: bool = True) -> "DataParallelAsyncLLM":
        parallel.check_parallel_config(args.tensor_parallel_size, args.data_parallel_size,
                                       args.pipeline_parallel_size, jax.device_count())
        model = model or load_model(args.model, args.dtype, progress)  # once; each replica shards its copy
        if args.pipeline_parallel_size > 1:  # replica i: the i-th run of tp x pp devices, split into its stages
            n = args.tensor_parallel_size * args.pipeline_parallel_size
            engines = [LLMEngine(args, model=model, progress=progress, devices=jax.devices()[i * n:(i + 1) * n])
                       for i in range(args.data_parallel_size)]
        else:
            mesh = parallel.make_mesh(args.tensor_parallel_size, args.data_parallel_size)
            engines = [LLMEngine(args, model=model, progress=progress, mesh=m) for m in parallel.replica_meshes(mesh)]
        for e in engines:  # the compile counter is per process: serving starts after the last warm-up
            e.compilations_at_warmup = num_compilations()
        return cls([AsyncLLM(e) for e in engines])

    @property
    def errored(self) -> bool:
        return any(r.errored for r in self.replicas)

    def startup_report(self) -> str:
        return "\n".join(f"replica {i}: {r.startup_report()}" for i, r in enumerate(self.replicas))

    async def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams, request_id: str,
                       *, prompt_logprobs: bool = False, lora_request=None) -> AsyncIterator[RequestOutput]:
        i = min(range(len(self.replicas)), key=lambda k: (self.in_flight[k], self.num_served[k]))
        self.in_flight[i] += 1
        self.num_served[i] += 1
        self._owner[request_id] = i
        try:
            async for out in self.replicas[i].generate(prompt, sampling_params, request_id, lora_request=lora_request):
                yield out
        finally:
            self.in_flight[i] -= 1
            self._owner.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    def get_stats(self) -> EngineStats:
        """Counts and counters summed over replicas; cache usage averaged, weighted by pool size."""
        stats = [r.get_stats() for r in self.replicas]
        total = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(EngineStats)}
        for name, blocks in (("kv_cache_usage", "num_gpu_blocks"), ("cpu_cache_usage", "num_cpu_blocks")):
            weight = sum(getattr(s, blocks) for s in stats)
            total[name] = sum(getattr(s, name) * getattr(s, blocks) for s in stats) / weight if weight else 0.0
        # Compilations are counted per process, and every replica sees the same counter.
        total["num_compilations"] = stats[0].num_compilations
        total["num_compilations_after_warmup"] = max(s.num_compilations_after_warmup for s in stats)
        return EngineStats(**total)

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()
