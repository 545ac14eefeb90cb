"""EngineConfig: the values derived from EngineArgs, computed once, and the parts derived from it."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.constants import CPU_MAX_MODEL_LEN
from jaxserve.core.spec_decode import SpeculativeConfig
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.config import CHUNKED_PREFILL_TOKENS, EngineConfig
from jaxserve.worker import sizing


@pytest.mark.parametrize("platform, max_pos, want", [("cpu", 8192, CPU_MAX_MODEL_LEN), ("gpu", 8192, 8192),
                                                     ("cpu", 1024, 1024)])
def test_max_model_len_cap_only_on_cpu(platform: str, max_pos: int, want: int) -> None:
    assert EngineConfig.resolve(EngineArgs(), max_pos, platform).max_model_len == want
    assert EngineConfig.resolve(EngineArgs(max_model_len=4096), max_pos, platform).max_model_len == 4096


def test_token_budget_default_follows_chunked_prefill() -> None:
    assert EngineConfig.resolve(EngineArgs(), 8192, "gpu").max_num_batched_tokens == CHUNKED_PREFILL_TOKENS
    whole = EngineConfig.resolve(EngineArgs(enable_chunked_prefill=False), 8192, "gpu")
    assert whole.max_num_batched_tokens == 8192
    assert EngineConfig.resolve(EngineArgs(max_num_batched_tokens=100), 8192, "gpu").max_num_batched_tokens == 100


@pytest.mark.parametrize("flag, platform, want", [("auto", "cpu", "xla"), ("auto", "gpu", "pallas"),
                                                  ("reference", "gpu", "xla"), ("xla", "gpu", "xla"),
                                                  ("pallas", "cpu", "pallas")])
def test_backend_resolved(flag: str, platform: str, want: str) -> None:
    assert EngineConfig.resolve(EngineArgs(attention_backend=flag), 2048, platform).attention_backend == want


@pytest.mark.parametrize("platform, want", [("cpu", (64, "bfloat16")), ("gpu", (16, "auto")), ("tpu", (16, "auto"))])
def test_platform_defaults_fill_only_the_flags_not_given(platform: str, want: tuple) -> None:
    config = EngineConfig.resolve(EngineArgs(), 2048, platform)
    assert (config.block_size, config.kv_cache_dtype) == want
    sized = config.with_blocks(10)
    assert (sized.runner_config().block_size, sized.runner_config().kv_cache_dtype) == want
    assert sized.scheduler_config().block_size == want[0]
    # The start-up log names what the CPU chose; explicit flags are kept and not reported.
    ngram = """--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'"""
    # bfloat16 dots where the CPU has the instructions (this project's hosts do; others keep float32)
    bf16 = platform == "cpu" and sizing.cpu_has_bf16_dots()
    dots = ("--dtype auto (float32 weights, bfloat16 dots in steps of 64+ tokens)",) if bf16 else ()
    assert config.platform_defaults == (("--block-size 64", "--kv-cache-dtype bfloat16", ngram, *dots)
                                        if platform == "cpu" else ())
    assert sized.runner_config().bf16_dots_from == (64 if bf16 else 0)
    assert sized.scheduler_config().speculative == (SpeculativeConfig(num_speculative_tokens=4)
                                                    if platform == "cpu" else None)
    exact = EngineConfig.resolve(EngineArgs(block_size=16, kv_cache_dtype="auto", speculative_config={},
                                            dtype="float32"), 2048, platform)
    assert (exact.block_size, exact.kv_cache_dtype, exact.speculative, exact.platform_defaults) == (16, "auto", None, ())
    assert exact.runner_config().bf16_dots_from == 0
    half = EngineConfig.resolve(EngineArgs(kv_cache_dtype="float32"), 2048, platform)
    assert half.kv_cache_dtype == "float32" and half.platform_defaults == (("--block-size 64", ngram, *dots)
                                                                           if platform == "cpu" else ())
    given = EngineConfig.resolve(EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                                 2048, platform)
    assert given.speculative == SpeculativeConfig(num_speculative_tokens=2) and not any(
        "speculative" in d for d in given.platform_defaults)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                      dict(data_parallel_size=2), dict(num_hosts=2)])
def test_cpu_ngram_default_only_on_one_device(parallel: dict) -> None:
    """The n-gram and bfloat16-dot defaults were measured on one CPU device; a parallel run drafts
    only when asked and keeps float32 dots."""
    config = EngineConfig.resolve(EngineArgs(**parallel), 2048, "cpu")
    assert config.speculative is None and config.platform_defaults == ("--block-size 64", "--kv-cache-dtype bfloat16")
    assert config.bf16_dots_from == 0


def test_parts_derived_and_nothing_written_back() -> None:
    args = EngineArgs(block_size=32, max_num_seqs=5, preemption_mode="swap", enable_prefix_caching=True,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    config = EngineConfig.resolve(args, 1000, "cpu")
    sized = config.with_blocks(num_gpu_blocks=77, num_cpu_blocks=9)
    assert config.num_gpu_blocks == 0 and sized.args is args and args.max_model_len is None
    sched, runner = sized.scheduler_config(), sized.runner_config()
    assert (sched.num_blocks, sched.num_cpu_blocks, sched.block_size, sched.max_num_seqs) == (77, 9, 32, 5)
    assert sched.enable_prefix_caching and sched.preemption_mode == "swap"
    assert sched.speculative == SpeculativeConfig(num_speculative_tokens=2)
    assert (runner.num_blocks, runner.num_cpu_blocks, runner.backend, runner.max_model_len) == (77, 9, "xla", 1000)
    assert sched.max_num_batched_tokens == runner.max_num_batched_tokens == config.max_num_batched_tokens
    assert config.min_blocks == -(-1000 // 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_model_len = 3  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "^max_num_seqs must be >= 1, got 0"),
    (dict(block_size=24), "^block_size must be one of"),
    (dict(dtype="float8"), "^dtype must be one of"),
    (dict(attention_backend="triton"), "^attention_backend must be one of"),
    (dict(max_num_seqs=2.0), "^max_num_seqs must be an integer"),
    (dict(gpu_memory_utilization=1.5), "^gpu_memory_utilization must be <= 0.95"),
    (dict(quantization="int8", tensor_parallel_size=2), "^quantization int8 runs on one device"),
    (dict(host_rank=2, num_hosts=2), "^host_rank must be in"),
    (dict(coordinator="host"), "^coordinator must be ADDR:PORT"),
    (dict(speculative_config={"num_speculative_tokens": 0}), "^speculative_config.num_speculative_tokens"),
])
def test_engine_args_errors_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
