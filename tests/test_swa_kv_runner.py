"""Sliding-window layers hold only their window in the KV pool, end to end (issue 49, the runner side).

A tiny random Gemma 3 saved by transformers with 12 layers (10 sliding, window 8; 2 global): KV groups of
k = 2 layers (one full group, layers 5 and 11; five sliding ones), so the pool is [2, ...] and layers read
slot 1 as well as slot 0 of their group's blocks. Float32 under the exact flags, the engine's greedy
tokens equal transformers' and each logprob is within 1e-4, with prompts and generations past the
window (blocks given back while the requests run, checked on the scheduler's tables), a prefix-cache hit
on a finished request's blocks, and recompute preemption in a pool too small for three such requests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.gemma_fixtures import save_gemma
from tests.logprob_parity import assert_logprobs_close, generated_logprobs
from tests.moe_fixtures import hf_reference, make_engine

PREFIX = [(7 * i + 3) % 250 + 2 for i in range(40)]
FIRST = [PREFIX + [11, 12, 13]]  # runs alone: its blocks are still cached when the second wave starts
SECOND = [PREFIX + [21, 22], [(5 * i + 1) % 240 + 3 for i in range(37)], [9, 200, 31] * 12]
MAX_TOKENS = 12
NUM_BLOCKS = 36  # 6 groups x 6 blocks (max_model_len 96): one request at its longest, not three at ~60 tokens


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[Path, dict[str, tuple[list[list[int]], list[list[float]]]]]:
    path = save_gemma("gemma3", tmp_path_factory.mktemp("swa") / "gemma3", num_hidden_layers=12)
    return path, {"first": hf_reference(path, FIRST, MAX_TOKENS), "second": hf_reference(path, SECOND, MAX_TOKENS)}


def _run_watching(engine, prompts: list[list[int]], tag: str) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and logprobs of `prompts` (in flight together), and the most blocks any one step
    saw given back (NULL slots in the sliding groups' tables of the running requests)."""
    from jaxserve.core.hybrid_kv_cache_manager import NULL_BLOCK
    from jaxserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    done, most_freed = {}, 0
    kv = engine.scheduler.kv
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        freed = sum(b == NULL_BLOCK for tables in kv.req_to_blocks.values() for t in tables for b in t)
        most_freed = max(most_freed, freed)
    outs = [done[f"{tag}{i}"] for i in range(len(prompts))]
    return [list(o.token_ids) for o in outs], [generated_logprobs(o) for o in outs], most_freed


def test_gemma3_groups_free_blocks_and_equal_transformers(gemma3):
    from jaxserve.core.hybrid_kv_cache_manager import HybridKVCacheManager

    path, reference = gemma3
    engine = make_engine(path, enforce_eager=True, max_model_len=96, max_num_seqs=3, enable_prefix_caching=True,
                         num_gpu_blocks_override=NUM_BLOCKS)
    try:
        layout = engine.config.kv_layout
        assert layout is not None and (layout.num_groups, layout.size) == (6, 2)
        assert [g.layers for g in layout.groups][:2] == [(5, 11), (0, 1)]
        assert isinstance(engine.scheduler.kv, HybridKVCacheManager)
        assert engine.runner.kv[0].shape[:3] == (2, 2, NUM_BLOCKS)  # [k, kv heads, blocks]: k layers a block
        for wave, prompts in (("first", FIRST), ("second", SECOND)):
            tokens, logprobs, freed = _run_watching(engine, prompts, wave)
            assert tokens == reference[wave][0], wave
            assert_logprobs_close(logprobs, reference[wave][1], what=f"gemma3 groups, {wave} wave")
            assert freed > 0, f"{wave}: no sliding group gave a block back"
        stats = engine.get_stats()
        assert stats.prefix_cache_hits >= 32  # the second wave's first prompt found the first's 2 blocks
        assert stats.num_preemptions > 0  # three requests outgrow the 36 blocks: recompute
        assert engine.scheduler.kv.num_free_blocks == NUM_BLOCKS  # everything given back at the end
    finally:
        engine.shutdown()


def test_layout_only_where_it_applies(gemma3):
    """Groups for a Gemma whose window a request can outgrow; one table (None) for a full-attention
    model, a window no request reaches, pipeline stages and --batch-invariant."""
    from jaxserve.weights.safetensors_dir import read_config
    from jaxserve.worker.kv_groups import kv_layout

    cfg = read_config(gemma3[0])
    assert kv_layout(cfg, 96) is not None
    assert kv_layout(dataclasses.replace(cfg, architecture="LlamaForCausalLM", sliding_layers=None,
                                         sliding_window=None), 96) is None
    assert kv_layout(cfg, 8) is None  # window 8 >= max_model_len: nothing could ever be freed
    assert kv_layout(cfg, 96, pipeline_parallel_size=2) is None
    assert kv_layout(cfg, 96, batch_invariant=True) is None


def test_pack_groups_lays_out_every_group():
    """Each group's table and slots in pack's token order; block 0 where a sliding group gave its block back."""
    from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.worker.input_batch import pack

    sp = SamplingParams(max_tokens=1)
    a = ScheduledRequest(request_id="a", token_ids=[1, 2], start_pos=30, block_ids=[4, 5],
                         block_tables=[[4, 5], [0, 7]], sample=True, sampling_params=sp)
    b = ScheduledRequest(request_id="b", token_ids=[3], start_pos=3, block_ids=[6], block_tables=[[6], [8]],
                         sample=True, sampling_params=sp)
    batch, _ = pack(SchedulerOutput(scheduled=[a, b]), 4, 4, 3, 16, num_groups=2)
    md = batch.attn
    np.testing.assert_array_equal(md.group_slot_mapping, [[5 * 16 + 14, 5 * 16 + 15, 6 * 16 + 3, -1],
                                                          [7 * 16 + 14, 7 * 16 + 15, 8 * 16 + 3, -1]])
    np.testing.assert_array_equal(md.group_block_tables[1, :2], [[0, 7, 0], [8, 0, 0]])
    np.testing.assert_array_equal(md.group_slot_mapping[0], md.slot_mapping)  # group 0 is block_ids'
    np.testing.assert_array_equal(md.group_block_tables[0], md.block_tables)
    one, _ = pack(SchedulerOutput(scheduled=[a, b]), 4, 4, 3, 16)
    assert one.attn.group_block_tables is None and one.attn.group_slot_mapping is None  # the old program's tree


def test_plan_counts_sliding_groups_at_long_context():
    """`jaxserve plan` on Gemma 3 1b's hub config (26 layers: 4 global, 22 sliding, window 512) at 32k
    context: blocks of k = 2 layers, a sequence holding 2 full groups' 2,048 blocks and 11 sliding
    groups' 34 (the window, LAG and the block it starts in): 17% of the same shape's full-attention KV."""
    from jaxserve.models.config import ModelConfig
    from jaxserve.plan.estimate import Setting, estimate

    hf = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
              intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
              head_dim=256, query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
              rope_theta=1000000, rope_local_base_freq=10000, rope_scaling=None, max_position_embeddings=32768)
    cfg = ModelConfig.from_hf(hf)
    full = dataclasses.replace(cfg, sliding_layers=None, sliding_window=None)
    kw = dict(gpu=None, max_model_len=32768, kv_cache_memory=8 << 30)
    grouped, dense = estimate(Setting(cfg, **kw)), estimate(Setting(full, **kw))
    assert dense["kv_groups"] is None and dense["kv_bytes_per_block"] == 26 * 2 * 256 * 16 * 2
    assert grouped["kv_bytes_per_block"] == 2 * 2 * 256 * 16 * 2
    assert grouped["blocks_per_seq"] == 2 * 2048 + 11 * 34 and dense["blocks_per_seq"] == 2048
    ratio = (grouped["blocks_per_seq"] * grouped["kv_bytes_per_block"]
             / (dense["blocks_per_seq"] * dense["kv_bytes_per_block"]))
    assert 0.16 < ratio < 0.18
    assert grouped["max_concurrent_seqs"] >= 5 * dense["max_concurrent_seqs"]
    assert not estimate(Setting(cfg, gpu=None, max_model_len=32768, kv_cache_memory=200 << 20))["fits"]  # < 13 x 32k


def _grouped_step_inputs(decode_only: bool, backend: str):
    """A Gemma 3 config of 12 layers (6 groups of k = 2), a [2, ...] pool of 4001 blocks (a shape nothing
    else in the program has, for hlo_checks) and a packed batch with every group's tables."""
    import jax
    import jax.numpy as jnp

    from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from jaxserve.models import llama
    from jaxserve.models.attention import kv_pool_dtype
    from jaxserve.models.config import ModelConfig
    from jaxserve.worker.input_batch import pack

    cfg = ModelConfig.from_hf(dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=128,
                                   hidden_size=64, intermediate_size=96, num_hidden_layers=12, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=256))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), llama.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    pool = (2, 2, 4001, 16, 16)
    dtype = kv_pool_dtype("auto", jnp.bfloat16, backend)
    kv = tuple(jax.ShapeDtypeStruct(pool, dtype) for _ in range(2))
    tables = lambda *full: [list(full)] + [[0] * (len(full) - 1) + [9 + g] for g in range(5)]  # noqa: E731
    seqs = [ScheduledRequest("a", [1], 40, [3, 4, 5], True, block_tables=tables(3, 4, 5)),
            ScheduledRequest("b", [2], 20, [6, 7], True, block_tables=tables(6, 7))]
    if not decode_only:
        seqs.append(ScheduledRequest("c", [3] * 9, 0, [8], True, block_tables=tables(8)))
    batch, _ = pack(SchedulerOutput(seqs, sum(len(s.token_ids) for s in seqs)), 16, 8, 8, 16,
                    decode_only=decode_only, num_groups=6)
    return cfg, params, kv, batch, np.zeros(8, np.int32), pool, dtype


@pytest.mark.parametrize("decode_only", [False, True])
def test_grouped_step_lowers_for_cuda_and_keeps_the_pool_in_place(decode_only):
    """With KV groups the Pallas kernels get the group's table and the pool slot as before (traced): the
    step still lowers to Triton for `cuda` and aliases the donated [k, ...] pool."""
    from jax import export

    from jaxserve.worker import hlo_checks
    from jaxserve.worker import model_runner as mr

    cfg, params, kv, batch, rows, pool, dtype = _grouped_step_inputs(decode_only, "pallas")
    exp = export.export(mr._model_step, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(params, kv, batch, rows, rows, cfg=cfg,
                                                                        backend="pallas")
    assert "xla.gpu.triton" in exp.mlir_module()
    assert hlo_checks.stablehlo_problems(exp.mlir_module(), pool, dtype) == []
