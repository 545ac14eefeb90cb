"""Random weights of a real model's shape, made on the device leaf by leaf (shared by scripts/gpu_deepseek.py
and scripts/gpu_vl.py): no model files, nothing through the host. Each element is an integer hash of its
index (one fused elementwise loop, as scripts/gpu_moe.py makes Qwen3-30B-A3B's: a 10 GB expert leaf needs
no float32 or random-bits buffer), uniform in [-a, a) with a = 2.6 / sqrt(fan_in), so activations stay
O(1); norms near 1, biases small. Throughput depends on shapes, not values.

Leaves that are not weights but facts of the config (DeepSeek's per-layer `sparse` flag, the vision
tower's `full` blocks) are given by the caller in `fixed`, by their path ("layers/sparse").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np

if TYPE_CHECKING:
    import jax


def hash_uniform(seed: int, shape: tuple[int, ...]) -> jax.Array:
    """Uniform [-1, 1) float32 values from a hash of each element's flat index and `seed`, made on the
    device (no float32 buffer on the host; traced inside the caller's jit)."""
    import jax
    import jax.numpy as jnp

    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[axis]
    h = (idx + jnp.uint32(seed * 0x9E3779B9 & 0xFFFFFFFF)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return ((h ^ (h >> 16)) >> 8).astype(jnp.float32) * (2.0 / (1 << 24)) - 1.0


def _fan_in(name: str, shape: tuple[int, ...]) -> int:
    """The input width of a leaf as the model multiplies it: weights are [..., in, out], the expert stacks
    [L, E, out, in], DeepSeek's w_uv [L, H, v, R] maps the latent R (its last axis) to v."""
    from jaxserve.models.expert_weights import EXPERT_STACKS

    if len(shape) < 2 or name == "embed":
        return 64
    if name in EXPERT_STACKS or name == "w_uv":
        return shape[-1]
    return shape[-2]


def random_params(shapes: Mapping, dtype: str, fixed: Mapping[str, np.ndarray] | None = None,
                  is_bias: Callable[[str], bool] = lambda name: name.endswith("_b")) -> dict:
    """A tree of device arrays of `shapes` (a tree of shape tuples) in `dtype`."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    fixed = dict(fixed or {})
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))

    def make(seed: int, shape: tuple[int, ...], kind: str, scale: float) -> jax.Array:
        u = hash_uniform(seed, shape)
        if kind == "norm":
            return (1.0 + 0.1 * u).astype(dt)
        return (u * scale).astype(dt)

    out = []
    for i, (path, shape) in enumerate(leaves):
        key = "/".join(str(getattr(p, "key", p)) for p in path)
        name = key.rsplit("/", 1)[-1]
        if key in fixed:
            value = np.asarray(fixed.pop(key))
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"{key}: the fixed value's shape {value.shape} is not the model's {shape}")
            out.append(jnp.asarray(value, dt))
            continue
        kind = "norm" if "norm" in name else "bias" if is_bias(name) else "weight"
        scale = 0.02 if kind == "bias" else 2.6 / np.sqrt(_fan_in(name, shape))
        out.append(jax.jit(make, static_argnums=(0, 1, 2, 3))(i + 1, tuple(shape), kind, float(scale)))
    if fixed:
        raise ValueError(f"fixed leaves not in the model's tree: {sorted(fixed)}")
    params = jax.tree.unflatten(treedef, out)
    jax.block_until_ready(params)
    return params


def num_params(shapes: Mapping) -> int:
    import jax

    return sum(int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
