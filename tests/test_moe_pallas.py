"""The MoE expert computation on the Pallas backend: the grouped matmul kernel
(pallas_kernels/grouped_matmul.py) inside the model's step.

  * the decode step of a tiny Qwen3-MoE exported for cuda (jax.export from this CPU host) holds
    the grouped-matmul Triton kernel, with and without expert parallelism (shard_map, 2 devices);
  * in interpret mode the model's greedy tokens with the Pallas path equal the XLA path's.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.models import llama
from jaxserve.models.attention import PALLAS_INTERPRET, kv_pool_dtype
from jaxserve.models.config import ModelConfig, MoeConfig
from jaxserve.worker.input_batch import StepInput, pack

# Qwen3-MoE's layout at a tiny size (K and N multiples of 16 for the kernel); layer 1 dense
MOE = MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                dense_layers=(1,))
CFG = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, moe=MOE)
BLOCK_SIZE, NUM_BLOCKS = 16, 32


def _batch(decode: bool):
    if decode:  # two sequences, one new token each: the decode-only program
        out = SchedulerOutput([ScheduledRequest("a", [1], 20, [3, 4], True),
                               ScheduledRequest("b", [2], 40, [5, 6, 7], True)], 2)
        return pack(out, 4, 4, 8, BLOCK_SIZE, decode_only=True)[0]
    out = SchedulerOutput([ScheduledRequest("a", [1] * 20, 0, [3, 4], True)], 20)
    return pack(out, 32, 4, 8, BLOCK_SIZE)[0]


def _shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype if not hasattr(a, "dtype")
                                                       else a.dtype), tree)


def _params(cfg, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = llama.param_shapes(cfg)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s) * 0.3, dtype), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def _export(cfg, params, sharding=None):
    kv_dtype = kv_pool_dtype("auto", jnp.bfloat16, "pallas")
    kv = tuple(jax.ShapeDtypeStruct((cfg.num_layers, cfg.num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, cfg.head_dim),
                                    kv_dtype) for _ in range(2))
    batch = _shapes(_batch(decode=True))
    assert batch.attn.decode_only

    def step(params, kv, b: StepInput):
        return llama.forward(params, cfg, kv, b.token_ids, b.positions, b.attn, backend="pallas")

    exp = export.export(jax.jit(step), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(params, kv, batch)
    return exp.mlir_module()


def test_decode_step_holds_the_grouped_matmul_kernel():
    """On one device the kernel takes every layer's whole [L, E, N, K] stacks and reads its layer's
    experts in place: a layer's slice handed to a custom call would be a copy of its whole stacks
    each step. No slice of a stack is taken anywhere in the step."""
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), llama.param_shapes(CFG),
                          is_leaf=lambda x: isinstance(x, tuple))
    text = _export(CFG, params)
    assert "xla.gpu.triton" in text
    rhs = set(re.findall(r'name = "grouped_matmul".*, (tensor<[\dx]+bf16>)\) ->', text))
    # [L, E, I, H], [L, E, H, I] over the 2 MoE layers (layer 1 is dense and holds no experts: layer_kinds.py)
    assert rhs == {"tensor<2x8x32x64xbf16>", "tensor<2x8x64x32xbf16>"}, rhs
    assert not re.search(r"dynamic_slice.*tensor<2x8x(32x64|64x32)xbf16>", text)


PARALLEL_EXPORT = r'''
import re, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxserve.models import llama, moe
from jaxserve.models.attention import PALLAS_INTERPRET
from jaxserve.models.config import with_expert_parallel
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.sharding import ModelShardings
from tests import test_moe_pallas as t
mesh = make_mesh(2)
for ep in (True, False):
    cfg = with_expert_parallel(t.CFG, ep)
    shardings = ModelShardings.create(mesh, cfg).params
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh), llama.param_shapes(cfg),
                          shardings, is_leaf=lambda x: isinstance(x, tuple))
    text = t._export(cfg, params)
    kernels = sorted(set(re.findall(r'xla.gpu.triton.*?name = "([a-z_]+)"', text)))
    rhs = sorted(set(re.findall(r'name = "grouped_matmul".*, (tensor<[\dx]+bf16>)\) ->', text)))
    print("EXPORT", "ep" if ep else "tp", kernels, rhs)
# the same shard_maps in interpret mode, against the unsplit XLA block
rng = np.random.default_rng(0)
w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), jnp.float32)
ex = moe.Experts(w(8, 32, 64), w(8, 32, 64), w(8, 64, 32))  # [E, out, in]
router = moe.Router(w(64, 8), None, top_k=2)
x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
want = moe.moe(x, router, ex)
run = jax.jit(moe.moe, static_argnames=("expert_parallel", "backend"))
for ep, specs in ((True, (P("model"),) * 3), (False, (P(None, "model", None),) * 2 + (P(None, None, "model"),))):
    split = moe.Experts(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((ex.w_gate, ex.w_up, ex.w_down), specs)))
    got = run(x, router, split, expert_parallel=ep, backend=PALLAS_INTERPRET)
    print("INTERPRET", "ep" if ep else "tp", float(jnp.max(jnp.abs(got - want))))
    # as the layer scan hands them over: layer 1 of [2, E, ...] stacks, read in place on each device
    from jaxserve.models.expert_weights import LayerStack
    layered = moe.Experts(*(LayerStack(jax.device_put(jnp.stack([-a, a]), NamedSharding(mesh, P(None, *s))), jnp.int32(1))
                            for a, s in zip((ex.w_gate, ex.w_up, ex.w_down), specs)))
    got = run(x, router, layered, expert_parallel=ep, backend=PALLAS_INTERPRET)
    print("LAYERED", "ep" if ep else "tp", float(jnp.max(jnp.abs(got - want))))
# gpt-oss's experts: biases and the clamped SwiGLU (the down bias added once, not once a device)
from jaxserve.models.gpt_oss import ClampedSwiGLU
biased = moe.Experts(ex.w_gate, ex.w_up, ex.w_down, w(8, 32, 32)[:, 0], w(8, 32, 32)[:, 1], w(8, 64, 64)[:, 0],
                     ClampedSwiGLU(1.702, 7.0))
want = moe.moe(x, router, biased)
for ep, specs in ((True, (P("model"),) * 6), (False, (P(None, "model", None),) * 2 + (P(None, None, "model"),)
                                                      + (P(None, "model"),) * 2 + (P(),))):
    leaves = (biased.w_gate, biased.w_up, biased.w_down, biased.b_gate, biased.b_up, biased.b_down)
    split = moe.Experts(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(leaves, specs)), biased.activation)
    got = run(x, router, split, expert_parallel=ep, backend=PALLAS_INTERPRET)
    print("BIASED", "ep" if ep else "tp", float(jnp.max(jnp.abs(got - want))))
'''


def test_parallel_decode_steps_lower_with_the_kernel_on_each_shard():
    """TP 2 over 2 fake CPU devices (a subprocess): with --enable-expert-parallel each device's
    grouped matmuls take its E / 2 experts; without, every expert's I / 2 slice (a shard_map: XLA
    cannot partition a Pallas kernel and would gather the whole stacks), both of every layer's
    stacks with the layer read in place. One psum each. In interpret mode both shard_maps equal
    the unsplit block."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", PARALLEL_EXPORT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {tuple(line.split()[:2]): line for line in proc.stdout.splitlines()
             if line.startswith(("EXPORT", "INT", "BIASED", "LAYERED"))}
    ep, tp = lines["EXPORT", "ep"], lines["EXPORT", "tp"]
    for line in (ep, tp):
        assert "'grouped_matmul'" in line and "'paged_attention_decode'" in line, line
    # each device's part of every layer's stacks, its layer read in place: [L, E / 2, N, K] with EP,
    assert "tensor<2x4x64x32xbf16>" in ep and "tensor<2x4x32x64xbf16>" in ep, ep
    assert "tensor<2x8x64x16xbf16>" in tp and "tensor<2x8x16x64xbf16>" in tp, tp  # [L, E, I / 2, H] without
    for mode in ("ep", "tp"):
        assert float(lines["INTERPRET", mode].split()[-1]) < 1e-5, lines["INTERPRET", mode]
        assert float(lines["BIASED", mode].split()[-1]) < 1e-5, lines["BIASED", mode]
        assert float(lines["LAYERED", mode].split()[-1]) < 1e-5, lines["LAYERED", mode]


def _random_model(cfg: ModelConfig):
    from pathlib import Path

    from jaxserve.weights.loader import LoadedModel

    leaves, treedef = jax.tree.flatten(llama.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    rng = np.random.default_rng(0)
    params = jax.tree.unflatten(treedef, [jnp.asarray(
        rng.standard_normal(s) * (0.1 if len(s) == 1 else 1.5 / np.sqrt(s[-2])) + (len(s) == 1), jnp.float32)
        for s in leaves])
    params["layers"]["sparse"] = jnp.asarray([float(cfg.moe.is_sparse(i)) for i in range(cfg.num_layers)])
    return LoadedModel(cfg, params, None, "random-tiny-moe", Path("."))


def _greedy(backend: str, monkeypatch) -> list[list[int]]:
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine import llm_engine

    monkeypatch.setattr(llm_engine, "resolve_backend", lambda name: backend)
    llm = LLM(_random_model(CFG), progress=False, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=64, num_gpu_blocks_override=32, enable_prefix_caching=False, compilation_cache_dir="",
              kv_cache_dtype="auto", block_size=16, speculative_config={})  # the exact float32 flags
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(0, CFG.vocab_size, n).tolist()} for n in (3, 11)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_interpret_mode_tokens_equal_the_xla_path(monkeypatch):
    """The whole model on the Pallas backend in interpret mode (attention kernels and the grouped
    matmul, on this CPU) gives the XLA path's greedy tokens."""
    want = _greedy("xla", monkeypatch)
    assert _greedy(PALLAS_INTERPRET, monkeypatch) == want


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_grouped_swiglu_equals_the_xla_paths(num_tokens):
    """expert_swiglu's grouped path (the Pallas kernel in interpret mode) and its gather / sorted
    paths against a numpy loop, ids past the experts (expert parallelism's other devices: 0) included."""
    from jaxserve.models import moe

    rng = np.random.default_rng(num_tokens)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), jnp.float32)  # noqa: E731
    ex = moe.Experts(w(8, 32, 64), w(8, 32, 64), w(8, 64, 32))  # [E, out, in]
    x = jnp.asarray(rng.standard_normal((num_tokens, 64)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 9, (num_tokens, 2)), jnp.int32)  # 8: not computed
    want = np.zeros((num_tokens, 2, 64))
    wg, wu, wd, xs = (np.asarray(v, np.float64) for v in (ex.w_gate, ex.w_up, ex.w_down, x))
    for t, j in np.ndindex(num_tokens, 2):
        e = int(ids[t, j])
        if e < 8:
            gate, up = wg[e] @ xs[t], wu[e] @ xs[t]
            want[t, j] = wd[e] @ (gate / (1 + np.exp(-gate)) * up)
    run = jax.jit(moe.expert_swiglu, static_argnames="backend")
    for backend in ("xla", PALLAS_INTERPRET):
        np.testing.assert_allclose(run(x, ids, ex, backend=backend), want, rtol=1e-5, atol=1e-5)


def test_fp8_block_experts_lower_for_cuda():
    """Block-wise fp8 expert stacks on the Pallas backend (the XLA blocked grouped matmul, each
    row block's expert dequantized) lower for cuda beside the attention kernels."""
    from jaxserve.quantization.qweight import QuantizedWeight

    shapes = llama.param_shapes(CFG)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), shapes, is_leaf=lambda x: isinstance(x, tuple))
    for leaf in ("we_gate", "we_up", "we_down"):
        *lead, n, k = shapes["layers"][leaf]  # [L, E, out, in]
        params["layers"][leaf] = QuantizedWeight(
            jax.ShapeDtypeStruct((*lead, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((*lead, -(-n // 32), -(-k // 32)), jnp.float32),
            scheme="fp8_block", group_size=32, block_cols=32)
    text = _export(CFG, params)
    assert "paged_attention_decode" in text and "f8E4M3FN" in text
