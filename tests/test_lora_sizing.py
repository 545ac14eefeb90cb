"""The LoRA slots in memory sizing: the engine's KV pool and `jaxserve plan` count them as weights.

On an accelerator the pool gets (memory x --gpu-memory-utilization - weights - LoRA slots -
activations) // bytes per block; the test plays an accelerator by fixing the device memory the
sizing reads (the CPU's own pool is --kv-cache-memory, which LoRA does not touch).
"""

from __future__ import annotations

import jax
import pytest

from jaxserve.engine import llm_engine
from jaxserve.models.config import ModelConfig
from jaxserve.worker import kv_sizing, sizing
from tests.test_lora_pallas import TINY
from tests.test_plan import run_plan

DEVICE_BYTES = 64 << 20
UTILIZATION = 0.5


def _engine(monkeypatch, **lora) -> llm_engine.LLMEngine:
    from jaxserve import LLM
    from tests.test_decode_routing import random_model

    monkeypatch.setattr(kv_sizing, "accelerator_memory_bytes", lambda: DEVICE_BYTES)
    llm = LLM(random_model(ModelConfig(architecture="LlamaForCausalLM", **TINY)), progress=False, dtype="float32",
              max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, enable_prefix_caching=False,
              compilation_cache_dir="", speculative_config={}, kv_cache_dtype="auto", block_size=16,
              gpu_memory_utilization=UTILIZATION, **lora)
    return llm.llm_engine


def test_lora_slots_reduce_the_kv_blocks_by_their_bytes(monkeypatch):
    engine = _engine(monkeypatch, enable_lora=True, max_loras=8, max_lora_rank=64)
    # the sizing's figure is the slots the runner allocated: every projection's A and B and the owners
    params = engine.runner.params
    allocated = sum(x.nbytes for x in jax.tree.leaves(params["layers"]["lora"])) + params["lora_owner"].nbytes
    assert engine.lora_bytes == allocated > 0
    per_block = sizing.kv_bytes_per_block(engine.model.config, engine.block_size, 4)  # a float32 pool
    budget = int(DEVICE_BYTES * UTILIZATION) - engine.weight_bytes  # what the pool had without LoRA
    assert engine.num_gpu_blocks == (budget - allocated) // per_block
    assert budget // per_block - engine.num_gpu_blocks >= allocated // per_block > 100  # a large share
    engine.shutdown()


def test_lora_slot_bytes_shard_with_their_projections():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)  # Llama-3.1-8B
    one = sizing.lora_slot_bytes(cfg, 8, 16, 2)
    # per layer, A [in, 128] and B [128, out] of q, k, v, o, gate, up, down in bfloat16, and the owners
    dims = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    assert one == 32 * sum(128 * (i + o) for i, o in dims) * 2 + 128 * 4
    two = sizing.lora_slot_bytes(cfg, 8, 16, 2, tensor_parallel_size=2)
    # column-parallel q/k/v/gate/up: B halves; row-parallel o/down: A halves
    split = sum(128 * o for _, o in dims[:3] + dims[4:6]) + sum(128 * i for i, _ in (dims[3], dims[6]))
    assert two == one - 32 * split // 2 * 2
    assert sizing.lora_slot_bytes(cfg, 0, 16, 2) == 0


@pytest.mark.parametrize("tp", ["1", "2"])
def test_plan_counts_the_lora_slots(tp):
    argv = ("meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--max-model-len", "8192", "-tp", tp)
    off = run_plan(*argv)
    on = run_plan(*argv, "--enable-lora", "--max-loras", "8", "--max-lora-rank", "64")
    assert off["lora_bytes"] == 0 and on["lora_bytes"] > 1 << 30
    assert on["kv_budget_bytes"] == off["kv_budget_bytes"] - on["lora_bytes"]
    assert on["num_gpu_blocks"] < off["num_gpu_blocks"]
    assert "--enable-lora --max-loras 8 --max-lora-rank 64" in on["flags"]


def test_engine_refuses_lora_slots_that_cannot_fit_before_loading(monkeypatch):
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.llm_engine import _lora_bytes
    from jaxserve.plan.source import read_model
    from tests.test_plan import _fit_flags

    monkeypatch.setattr(kv_sizing, "accelerator_memory_bytes", lambda: 24 << 30)  # a 24 GiB device
    cfg = read_model("meta-llama/Llama-3.1-8B-Instruct").config
    flags = _fit_flags(EngineArgs(max_model_len=4096))
    kv_sizing.refuse_oversized_weights(cfg, 2, **flags)  # 16 GB of bfloat16 weights fit
    args = EngineArgs(max_model_len=4096, enable_lora=True, max_loras=32, max_lora_rank=256)
    lora = _lora_bytes(args, cfg, 2, 1)
    assert lora == sizing.lora_slot_bytes(cfg, 32, 256, 2) > 40e9
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: weights \(\d+ bytes\)"):
        kv_sizing.refuse_oversized_weights(cfg, 2, **flags, lora_bytes=lora)
