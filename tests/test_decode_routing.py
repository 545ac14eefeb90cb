"""Decode-only steps on the Pallas decode kernel: a static flag in the attention metadata picks
the kernel per compiled program; the engine's greedy tokens match the XLA path's.

The engine runs the Pallas kernels in interpret mode here (the CPU runs the kernels' own code),
so the routing, the row layout the decode kernel reads and the padding rows are all exercised;
the export test shows the decode program lowers to the decode kernel's Triton call for `cuda`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.engine import llm_engine
from jaxserve.entrypoints.llm import LLM
from jaxserve.models import attention, llama
from jaxserve.models.config import ModelConfig
from jaxserve.weights.loader import LoadedModel
from jaxserve.worker.input_batch import is_decode_only, pack

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def random_model(cfg: ModelConfig) -> LoadedModel:
    leaves, treedef = jax.tree.flatten(llama.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.standard_normal(s) * (0.1 if len(s) == 1 else 1.5 / np.sqrt(s[-2])) + (len(s) == 1),
                          jnp.float32) for s in leaves]
    return LoadedModel(cfg, jax.tree.unflatten(treedef, params), None, "random-tiny", Path("."))


def test_is_decode_only_and_pack_flag():
    decode = SchedulerOutput([ScheduledRequest("a", [5], 7, [0], True), ScheduledRequest("b", [6], 3, [1], True)], 2)
    mixed = SchedulerOutput([ScheduledRequest("a", [5, 6], 0, [0], True)], 2)
    assert is_decode_only(decode) and not is_decode_only(mixed) and not is_decode_only(SchedulerOutput())
    batch, _ = pack(decode, 16, 4, 4, 16, decode_only=True)
    assert batch.attn.decode_only and not pack(decode, 16, 4, 4, 16)[0].attn.decode_only
    with pytest.raises(ValueError, match="decode_only"):
        pack(mixed, 16, 4, 4, 16, decode_only=True)


def _generate(backend: str, max_num_seqs: int, monkeypatch, async_scheduling: bool = False
              ) -> tuple[list[list[int]], list[bool]]:
    monkeypatch.setattr(llm_engine, "resolve_backend", lambda name: backend)
    llm = LLM(random_model(CFG), progress=False, dtype="float32", max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
              max_model_len=128, num_gpu_blocks_override=64, enable_prefix_caching=False, compilation_cache_dir="",
              async_scheduling=async_scheduling)
    runner = llm.llm_engine.runner
    flags: list[bool] = []
    prepare = runner.prepare

    def spy(out):
        p = prepare(out)
        if p.batch is not None:
            flags.append(p.batch.attn.decode_only)
        return p

    monkeypatch.setattr(runner, "prepare", spy)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(0, CFG.vocab_size, n).tolist()} for n in (3, 17, 9, 30, 1)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.get_stats().num_compilations_after_warmup == 0  # warm-up compiled the decode programs
    return [o.outputs[0].token_ids for o in outs], flags


# 32 sequence rows: a decode step's 16 token rows are the metadata's first 16 (the GPU's case; fewer
# than 16 rows would pad them instead, which the export test below lowers).
@pytest.mark.warmup  # holds 0 compilations after warm-up
@pytest.mark.parametrize("max_num_seqs", [32])
def test_engine_pallas_decode_routing_matches_xla(max_num_seqs, monkeypatch):
    want, xla_flags = _generate("reference", max_num_seqs, monkeypatch)
    assert not any(xla_flags)  # the XLA path has no decode-only programs
    for async_scheduling in (False, True):  # async: the decode inputs are the previous step's ids on the device
        got, flags = _generate(attention.PALLAS_INTERPRET, max_num_seqs, monkeypatch, async_scheduling)
        assert any(flags) and not all(flags)  # prompt steps on the ragged kernel, decode steps on the decode kernel
        assert got == want


def test_decode_only_step_lowers_to_the_decode_kernel_for_cuda():
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), llama.param_shapes(CFG),
                          is_leaf=lambda x: isinstance(x, tuple))
    kv = tuple(jax.ShapeDtypeStruct((CFG.num_layers, CFG.num_kv_heads, 33, 16, CFG.head_dim), jnp.bfloat16)
               for _ in range(2))
    out = SchedulerOutput([ScheduledRequest("a", [1], 20, [3, 4], True),
                           ScheduledRequest("b", [2], 40, [5, 6, 7], True)], 2)

    def lowered(decode_only: bool) -> str:
        batch, _ = pack(out, 16, 8, 8, 16, decode_only=decode_only)  # 16 token rows > 8 seq rows: padded
        batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), batch)
        step = jax.jit(lambda p, kv, b: llama.forward(p, CFG, kv, b.token_ids, b.positions, b.attn, backend="pallas"))
        exp = export.export(step, platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(params, kv, batch)
        return exp.mlir_module()

    decode, ragged = lowered(True), lowered(False)  # kernel names appear quoted in their call's location
    assert "xla.gpu.triton" in decode and '"paged_attention_decode"' in decode
    assert '"ragged_paged_attention"' not in decode
    assert "xla.gpu.triton" in ragged and '"ragged_paged_attention"' in ragged
    assert '"paged_attention_decode"' not in ragged
