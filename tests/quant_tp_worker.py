"""Run with several fake CPU devices (tests/test_quantization.py starts it): quantized weights
(4-bit act-order GPTQ-style, fp8) sharded for tensor parallelism give the single-device logits."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import parallel
from jaxserve.models.config import ModelConfig
from jaxserve.quantization.qweight import FP8_MAX, fp8_block, pack_int, stack
from jaxserve.quantization.quantize import LINEAR_LEAVES, quantize_weight
from tests.paged_helpers import paged_logits
from tests.parallel_worker import BASE, FAMILIES, random_params

PROMPTS, CONTINUATIONS = [[5, 17, 99, 3, 42], [8, 1, 60]], [[11, 12], [200, 201]]


def _w4(w: np.ndarray, rng) -> object:
    """[L, K, N] float -> a 4-bit QuantizedWeight (group 16, act order) with leading L."""
    layers = []
    for wl in w:
        k, n = wl.shape
        g_idx = (np.arange(k) // 16)[rng.permutation(k)]
        scales = np.full((k // 16, n), np.abs(wl).max() / 7, np.float32)
        q = np.clip(np.round(wl / scales[g_idx]) + 8, 0, 15)
        layers.append(pack_int(q, scales, np.full(scales.shape, 8), g_idx, 4, jnp.float32))
    return jax.tree.map(jnp.asarray, stack(layers))


def _fp8_block(w: np.ndarray, block: int = 16) -> object:
    """[L, K, N] float -> block-wise fp8 as the hub stores it (HF [N, K] e4m3, scale_inv per block)."""
    layers = []
    for wl in w:
        hf = wl.T  # [N, K]
        n, k = hf.shape
        amax = np.abs(hf.reshape(n // block, block, k // block, block)).max(axis=(1, 3))
        scale_inv = (np.maximum(amax, 1e-12) / FP8_MAX).astype(np.float32)
        q = np.asarray(jnp.asarray(hf / np.repeat(np.repeat(scale_inv, block, 0), block, 1)).astype(jnp.float8_e4m3fn))
        layers.append(fp8_block(q, scale_inv, (block, block)))
    return jax.tree.map(jnp.asarray, stack(layers))


def main(tp: int) -> None:
    cfg = ModelConfig(**{**BASE, **FAMILIES["llama_gqa"]})
    host = random_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    out = {}
    make = {"w4a16": lambda v: _w4(np.asarray(v), rng), "fp8": lambda v: quantize_weight(jnp.asarray(v), "fp8"),
            "fp8_block": lambda v: _fp8_block(np.asarray(v))}
    for scheme in make:
        layers = {k: make[scheme](v) if k in LINEAR_LEAVES else jnp.asarray(v) for k, v in host["layers"].items()}
        params = {**jax.tree.map(jnp.asarray, host), "layers": layers}
        want = paged_logits(params, cfg, PROMPTS, CONTINUATIONS)
        mesh = parallel.make_mesh(tp, 1)
        sharded = parallel.shard_params(params, mesh, cfg)
        summary = parallel.sharding_summary(mesh, cfg, sharded)
        got = paged_logits(sharded, cfg, PROMPTS, CONTINUATIONS)
        rel = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))
        wq, wo = sharded["layers"]["wq"], sharded["layers"]["wo"]
        out[scheme] = {"rel": rel, "split": [wq.split and wq.split[2], wo.split and wo.split[2]],
                       "wq_values": list(wq.values.addressable_shards[0].data.shape),
                       "wq_scales": list(wq.scales.addressable_shards[0].data.shape),
                       "wo_values": list(wo.values.addressable_shards[0].data.shape),
                       "wo_scales": list(wo.scales.addressable_shards[0].data.shape),
                       "wq_full": list(wq.values.shape), "wo_full": list(wo.values.shape),
                       "wo_scales_full": list(wo.scales.shape), "summary": summary}
    out["kernel"] = check_w4a16_kernel(tp)
    print(json.dumps(out))


def check_w4a16_kernel(tp: int) -> dict:
    """The Pallas W4A16 kernel on a column- and a row-split weight of a size it takes (the tiny
    model's are too small): run in interpret mode inside its shard_map against the dequantized
    product, and lowered for cuda (jax.export) to read the kernel's operand types there."""
    import dataclasses

    from jax import export
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.quantization.matmul import matmul, w4a16_kernel
    from jaxserve.quantization.qweight import dequantize
    from jaxserve.quantization.sharding import quantized_spec

    k, n, group = 1024, 2048, 128
    rng = np.random.default_rng(1)
    w = pack_int(rng.integers(0, 16, (k, n)), (rng.random((k // group, n)) / 100).astype(np.float32),
                 rng.integers(0, 16, (k // group, n)), None, 4, jnp.float32)
    mesh = parallel.make_mesh(tp, 1)
    x = jax.device_put(jnp.asarray(rng.standard_normal((16, k)), jnp.float32), NamedSharding(mesh, P()))
    want = np.asarray(x @ dequantize(w))
    result = {}
    for kind, spec in (("column", P(None, None, "model")), ("row", P(None, "model", None))):
        specs = jax.tree.map(lambda s: P(*tuple(s)[1:]), quantized_spec(spec, w, tp),
                             is_leaf=lambda v: isinstance(v, P))  # the per-layer spec: no layer axis
        ws = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), w, specs,
                          is_leaf=lambda v: isinstance(v, P))
        ws = dataclasses.replace(ws, split=(mesh, "model", kind))
        got = np.asarray(jax.jit(lambda x, w: w4a16_kernel(x, w, interpret=True))(x, ws))
        text = export.export(jax.jit(matmul), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(x, ws).mlir_module()
        calls = [line.rsplit(" : ", 1)[-1] for line in text.splitlines() if "@__gpu$xla.gpu.triton" in line]
        result[kind] = {"rel": float(np.abs(got - want).max() / np.abs(want).max()), "signatures": calls,
                        "all_reduce": "stablehlo.all_reduce" in text}
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]))
