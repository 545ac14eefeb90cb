"""Data parallelism: M independent engine replicas, each on its own (data=1, model=tp) slice
of the devices (with pipeline stages: its own run of tp x pp devices), behind one server. A request goes to the replica with the fewest requests in
flight and stays there; the replicas share nothing, so they need no collectives at all.
This file builds the replicas' engines; the router in front of them is async_llm.py's
DataParallelAsyncLLM (AsyncLLM.from_engine_args picks it for --data-parallel-size > 1)."""

from __future__ import annotations

import jax

from jaxserve import parallel
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.lora.manager import check_lora_model
from jaxserve.engine.pooling import is_encoder, pooling_info
from jaxserve.worker.model_runner import num_compilations
from jaxserve.weights.loader import LoadedModel, load_model
from jaxserve.weights.source import describe_model


def replica_engines(args: EngineArgs, model: LoadedModel | None = None, progress: bool = True) -> list[LLMEngine]:
    """One LLMEngine per data-parallel replica, the weights loaded once (each replica shards its copy);
    async_llm.py's DataParallelAsyncLLM serves them."""
    parallel.check_parallel_config(args.tensor_parallel_size, args.data_parallel_size,
                                   args.pipeline_parallel_size, jax.device_count())
    if args.enable_lora and model is None:  # refused before the weights are read, as one engine does
        check_lora_model(describe_model(args.model).config)
    info = pooling_info(args)
    if info is None or not is_encoder(info):  # (an encoder replica loads its own small weights)
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
    return engines
