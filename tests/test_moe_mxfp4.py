"""MXFP4 expert stacks (quantization/mxfp4.py's Mxfp4Weight, gpt-oss's hub format) in the MoE block:
every path of moe.moe -- gather (a few rows), sorted (more rows), grouped (the Pallas backend's,
packed weights through the XLA blocked grouped matmul) and expert parallelism's shard_map --
gives exactly what the same block gives with the dequantized bfloat16 weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import moe
from jaxserve.models.attention import PALLAS_INTERPRET
from jaxserve.models.expert_weights import take_experts
from jaxserve.quantization.mxfp4 import Mxfp4Weight, dequantize

E, H, I = 8, 64, 32


def packed(rng, k: int, n: int) -> Mxfp4Weight:
    """A random [E, N, K] stack as the hub packs it (scales near 2^0)."""
    blocks = rng.integers(0, 256, (E, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(122, 128, (E, n, k // 32), dtype=np.uint8)
    return Mxfp4Weight(jnp.asarray(blocks), jnp.asarray(scales))


def experts_and_router(seed: int = 0):
    rng = np.random.default_rng(seed)
    ex = moe.Experts(packed(rng, H, I), packed(rng, H, I), packed(rng, I, H))
    router = moe.Router(jnp.asarray(rng.standard_normal((H, E)), jnp.bfloat16), None, top_k=2, norm_topk_prob=True)
    dense = moe.Experts(*(dequantize(w, jnp.bfloat16) for w in (ex.w_gate, ex.w_up, ex.w_down)))
    return ex, dense, router, rng


# grouped with 4 rows < E: the blocks' experts unpacked one by one; with 80: the stack once
@pytest.mark.parametrize("num_tokens,backend", [(3, "xla"), (40, "xla"), (2, PALLAS_INTERPRET),
                                                (40, PALLAS_INTERPRET)])
def test_mxfp4_experts_equal_the_dequantized_bf16_ones(num_tokens, backend):
    ex, dense, router, rng = experts_and_router(num_tokens)
    x = jnp.asarray(rng.standard_normal((num_tokens, H)), jnp.bfloat16)
    run = jax.jit(moe.moe, static_argnames=("expert_parallel", "backend"))
    got = run(x, router, ex, backend=backend)
    want = run(x, router, dense, backend=backend)
    assert got.dtype == jnp.bfloat16 and np.any(np.asarray(want, np.float32) != 0)
    if num_tokens * 2 > E and backend == "xla":  # packed stacks loop over the experts, float ones take
        # the batched dots: the same products summed in another order, within a bfloat16 ulp
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -7, atol=0)
    else:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_only_the_asked_experts_are_unpacked():
    ex, dense, _, _ = experts_and_router()
    ids = jnp.asarray([5, 2, 5], jnp.int32)
    got = take_experts(ex.w_down, ids, jnp.bfloat16)  # [3, H, I]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(dense.w_down, np.float32)[[5, 2, 5]])


EP_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxserve.models import moe
from jaxserve.parallel.mesh import make_mesh
from tests.test_moe_mxfp4 import H, experts_and_router
mesh = make_mesh(2)
ex, dense, router, rng = experts_and_router(7)
split = lambda tree: jax.device_put(tree, jax.tree.map(lambda _: NamedSharding(mesh, P("model")), tree))
run = jax.jit(moe.moe, static_argnames=("expert_parallel", "backend"))
for t, backend in ((3, "xla"), (40, "xla"), (40, "pallas-interpret")):
    x = jnp.asarray(rng.standard_normal((t, H)), jnp.bfloat16)
    got = run(x, router, split(ex), expert_parallel=True, backend=backend)
    want = run(x, router, dense)
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    same_path = t * 2 <= 8 or backend != "xla"  # else packed loops, float takes the batched dots
    assert np.array_equal(g, w) if same_path else np.allclose(g, w, rtol=2 ** -7, atol=0), (t, backend)
    text = run.lower(x, router, split(ex), expert_parallel=True, backend=backend).as_text()
    assert "all-reduce" in text or "all_reduce" in text, "no psum: expert parallel path not taken"
print("EP OK")
'''


def test_expert_parallel_shard_map_takes_mxfp4_stacks():
    """The packed stacks split over 2 fake CPU devices on their expert axis (blocks and scales
    alike), each device's experts unpacked in its shard, one psum: equal to the unsplit bf16 block."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", EP_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and "EP OK" in proc.stdout, proc.stderr[-3000:]
