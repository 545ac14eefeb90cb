"""Engines clean up after themselves: `shutdown()`, `with LLM(...)`, and plain dropping free the KV
pool, the weights the engine made and its compiled programs, so one process can build engines of
many configurations one after another. Each XLA:CPU program maps ~130 regions into the process
(~4,800 a warm-up) and vm.max_map_count is 65,530: before engines owned their programs, a process
crashed after about a dozen. scripts/lifecycle_engines.py runs the same loop with 50 engines."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.config import ModelConfig
from jaxserve.weights.loader import LoadedModel
from tests.parallel_worker import BASE, random_params

# Tiny grids (token buckets up to 8-16, 1-4 sequences): a warm-up of ~20 small programs each.
# Every configuration differs from the others in its shapes, so none reuses another's programs.
CONFIGS = [dict(block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=tokens, num_gpu_blocks_override=blocks)
           for bs, seqs, tokens, blocks in [(8, 1, 8, 16), (16, 2, 16, 17), (32, 1, 16, 18), (8, 2, 8, 19),
                                            (16, 1, 8, 20), (32, 2, 8, 21), (8, 4, 16, 22), (16, 4, 8, 23)]]
COMMON = dict(max_model_len=32, enable_chunked_prefill=True, dtype="float32", kv_cache_dtype="auto",
              speculative_config={}, enable_prefix_caching=False, compilation_cache_dir="")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# Growth allowed after the first engines: a handful of maps per engine (eager-op caches), where an
# engine that kept its programs added thousands; memory as live bytes (after malloc_trim: XLA's
# compiler leaves freed arenas that glibc returns only then).
MAX_MAPS_GROWTH = 400
MAX_RSS_GROWTH_MIB = 120


def num_memory_maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def rss_mib() -> float:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.fixture(scope="module")
def tiny_model() -> LoadedModel:
    cfg = ModelConfig(**BASE)
    return LoadedModel(cfg, jax.tree.map(jnp.asarray, random_params(cfg)), None, "random-tiny", Path("."))


def _engine(model: LoadedModel, i: int) -> LLMEngine:
    return LLMEngine(EngineArgs(**COMMON, **CONFIGS[i % len(CONFIGS)]), model=model, progress=False)


def _generate(engine: LLMEngine) -> list[int]:
    engine.add_request("r", [5, 17, 3, 99], GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)
    raise AssertionError("no output")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_engines_of_many_configurations_come_and_go_with_flat_maps_and_memory(tiny_model):
    """Eight configurations (block sizes, batch and sequence limits, pool sizes), each built, used and
    released three ways in turn; memory maps and live memory stay flat after the first two."""
    counts, rss = [], []
    reference = None
    for i in range(len(CONFIGS)):
        how = i % 3
        if how == 0:  # explicit shutdown
            engine = _engine(tiny_model, i)
            tokens = _generate(engine)
            engine.shutdown()
        elif how == 1:  # a context manager
            with _engine(tiny_model, i) as engine:
                tokens = _generate(engine)
            assert engine.is_closed
        else:  # dropped: the collector's __del__
            engine = _engine(tiny_model, i)
            tokens = _generate(engine)
        del engine
        gc.collect()
        reference = reference or tokens
        assert tokens == reference, f"config {i}: greedy tokens differ"  # same model, any configuration
        counts.append(num_memory_maps())
        rss.append(rss_mib())
    assert max(counts[2:]) - counts[1] < MAX_MAPS_GROWTH, f"memory maps grew: {counts}"
    assert max(rss[2:]) - rss[1] < MAX_RSS_GROWTH_MIB, f"live memory grew (MiB): {[round(r) for r in rss]}"


def test_shutdown_frees_the_pool_keeps_borrowed_weights_and_refuses_new_work(tiny_model):
    engine = _engine(tiny_model, 0)
    pool = jax.tree.leaves(engine.runner.kv)
    programs = engine.runner.programs
    engine.add_request("unfinished", [1, 2, 3], GREEDY)
    engine.shutdown()
    assert all(x.is_deleted() for x in pool)
    assert programs.__dict__.get("model_step") is None  # the runner's jit wrappers are gone
    # the weights were the caller's (a LoadedModel passed in): still alive for the next engine
    assert not any(x.is_deleted() for x in jax.tree.leaves(tiny_model.params))
    assert not engine.has_unfinished_requests()  # aborted
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("late", [1, 2], GREEDY)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    engine.shutdown()  # idempotent
    np.testing.assert_equal(_generate(_engine(tiny_model, 0)), _generate(_engine(tiny_model, 0)))


def test_llm_context_manager_and_shutdown(tiny_model):
    with LLM(tiny_model, progress=False, **COMMON, **CONFIGS[1]) as llm:
        out = llm.generate({"prompt_token_ids": [5, 17, 3, 99]}, GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        pool = jax.tree.leaves(llm.llm_engine.runner.kv)
    assert all(x.is_deleted() for x in pool) and llm.llm_engine.is_closed
    llm.shutdown()  # again: a no-op
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)


def test_async_llm_shutdown_stops_its_thread_and_releases_the_engine(tiny_model):
    from jaxserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM(_engine(tiny_model, 0))
    thread = engine._thread
    engine.shutdown()
    assert not thread.is_alive() and engine.engine.is_closed
