"""The KV pool is updated in place, provably: the model step, the block-copy and the swap-in
programs alias the pool input to output, and no pool-sized copy appears, compiled for the CPU
(the XLA path) and lowered for `cuda` (the Pallas path, via jax.export).

The pool has 4001 blocks so its shape matches nothing else in the programs, and is larger than
any activation (the memory analysis check); a program that did copy
the pool would show a `copy` (or a fusion/op producing the pool shape that is not a scatter or
dynamic-update-slice into it), or a temporary at least one pool large in XLA's memory analysis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.models import llama
from jaxserve.models.attention import kv_pool_dtype
from jaxserve.models.config import ModelConfig
from jaxserve.worker import hlo_checks
from jaxserve.worker import model_runner as mr
from jaxserve.worker.input_batch import pack

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS = 4001, 16, 8, 8
POOL = (CFG.num_layers, CFG.num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, CFG.head_dim)
NO_TRITON_CHECK = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def _inputs(dtype, backend: str, decode_only: bool = False):
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), llama.param_shapes(CFG),
                          is_leaf=lambda x: isinstance(x, tuple))
    pool_dtype = kv_pool_dtype("auto", dtype, backend)
    kv = tuple(jax.ShapeDtypeStruct(POOL, pool_dtype) for _ in range(2))
    seqs = [ScheduledRequest("a", [1], 20, [3, 4], True), ScheduledRequest("b", [2], 40, [5, 6, 7], True)]
    if not decode_only:
        seqs.append(ScheduledRequest("c", [3] * 9, 0, [8], True))
    out = SchedulerOutput(seqs, sum(len(s.token_ids) for s in seqs))
    batch, _ = pack(out, 16, MAX_SEQS, MAX_BLOCKS, BLOCK_SIZE, decode_only=decode_only)
    return params, kv, batch, np.zeros(MAX_SEQS, np.int32), pool_dtype  # rows [P]; also prev_tokens [P]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])  # bfloat16: the pool holds uint16 bits on CPU
def test_model_step_updates_the_pool_in_place_on_cpu(dtype):
    params, kv, batch, rows, pool_dtype = _inputs(dtype, "xla")
    compiled = mr._model_step.lower(params, kv, batch, rows, rows, cfg=CFG, backend="xla").compile()
    assert hlo_checks.compiled_problems(compiled, POOL, pool_dtype) == []


@pytest.mark.parametrize("decode_only", [False, True])
def test_model_step_aliases_the_pool_for_cuda(decode_only):
    params, kv, batch, rows, pool_dtype = _inputs(jnp.bfloat16, "pallas", decode_only)
    exp = export.export(mr._model_step, platforms=["cuda"], disabled_checks=NO_TRITON_CHECK)(
        params, kv, batch, rows, rows, cfg=CFG, backend="pallas")
    assert hlo_checks.stablehlo_problems(exp.mlir_module(), POOL, pool_dtype) == []


def _block_programs(dtype):
    kv = tuple(jax.ShapeDtypeStruct(POOL, dtype) for _ in range(2))
    ids = np.zeros(8, np.int32)
    blocks = np.zeros((*POOL[:2], 8, *POOL[3:]), dtype)
    return [(mr._copy_blocks, (kv, ids, ids)), (mr._scatter_blocks, (kv, ids, blocks, blocks))]


@pytest.mark.parametrize("which", [0, 1], ids=["copy_blocks", "scatter_blocks"])
def test_block_programs_update_the_pool_in_place(which):
    fn, args = _block_programs(np.float32)[which]
    assert hlo_checks.compiled_problems(fn.lower(*args).compile(), POOL, np.float32) == []
    fn, args = _block_programs(jnp.bfloat16)[which]
    exp = export.export(fn, platforms=["cuda"])(*args)
    assert hlo_checks.stablehlo_problems(exp.mlir_module(), POOL, jnp.bfloat16, allow_scatter=True) == []


def test_the_checks_catch_a_copy():
    """The checks can fail: a program that returns a changed copy of an undonated pool, and one
    whose donated pool is rewritten elementwise, are both reported."""
    kv = jax.ShapeDtypeStruct(POOL, jnp.float32)
    undonated = jax.jit(lambda k: (k.at[:, :, 3].set(1.0), k * 2))
    problems = hlo_checks.compiled_problems(undonated.lower(kv).compile(), POOL, np.float32, num_pools=1)
    assert any("not aliased" in p for p in problems) or any("aliased <" in p for p in problems)
    rewrite = jax.jit(lambda k: k * 2 + 1, donate_argnums=0)
    problems = hlo_checks.compiled_problems(rewrite.lower(kv).compile(), POOL, np.float32, num_pools=1)
    assert any("new pool-sized buffer" in p or "not in place" in p for p in problems), problems
    exp = export.export(rewrite, platforms=["cuda"])(kv)
    assert hlo_checks.stablehlo_problems(exp.mlir_module(), POOL, np.float32, num_pools=1)
    assert hlo_checks.stablehlo_problems(export.export(jax.jit(lambda k: k.at[0].set(0.0)), platforms=["cuda"])(kv)
                                         .mlir_module(), POOL, np.float32, num_pools=1)
