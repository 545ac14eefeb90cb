"""MoE expert stacks kept as a bfloat16 checkpoint's bits: which models keep them, and the start-up
conversion of those that arrive as float32.

    keeps_bf16_experts(...) --True--> load_model(expert_bits=True): the loader reads the experts
                                      as their bits, layer by layer, never widened to float32
                                      (weights/assemble.py)
                          --True--> with_bf16_experts(model): a LoadedModel passed in, or a float32
                                      checkpoint holding bfloat16 values, converted at start-up
    expert_width(params), bf16_experts_note(params): what the engine's weights figure and start-up
                                      report say of such stacks (2 bytes an element)

Every path of models/moe.py widens the experts it reads to float32 exactly inside its product; the
batched dots of a step of bfloat16 dots read each layer's own arrays as bfloat16
(models/expert_weights.py). Other weights stay float32. Why (half float32's memory for the experts,
faster batched dots), with the figures: docs/design/moe.md and docs/benchmarks/log.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.models.attention import PALLAS_BACKENDS, resolve_backend
from jaxserve.models.expert_weights import BF16_BITS, EXPERT_STACKS, with_bf16_bits
from jaxserve.weights.loader import LoadedModel


def keeps_bf16_experts(bf16_dots_from: int, attention_backend: str) -> bool:
    """Whether a bfloat16 checkpoint's MoE expert stacks are kept as their bfloat16 bits: the CPU
    default, where the engine takes bfloat16 dots (`bf16_dots_from` > 0: `--dtype auto` on one CPU
    device with bfloat16 dot instructions, engine/config.default_bf16_dots_from; 0 under any
    parallelism), on the XLA attention path (the Pallas kernels take float stacks)."""
    return bf16_dots_from > 0 and resolve_backend(attention_backend) not in PALLAS_BACKENDS


def with_bf16_experts(model: LoadedModel) -> LoadedModel:
    """`model` with float32 expert stacks that hold only bfloat16 values as their bits (a
    LoadedModel passed in, a float32 checkpoint of bfloat16 values); the loader's bits as they are."""
    layers = with_bf16_bits(model.params["layers"])
    if layers is model.params["layers"]:
        return model
    return dataclasses.replace(model, params={**model.params, "layers": layers})


def bf16_bits_stacks(params: dict) -> list[jax.Array]:
    """The expert stacks, where all are kept as bfloat16 bits (`keeps_bf16_experts`); else []."""
    stacks = [params.get("layers", {}).get(k) for k in EXPERT_STACKS]
    return stacks if all(isinstance(w, jax.Array) and w.dtype == BF16_BITS for w in stacks) else []


def expert_width(params: dict) -> int | None:
    """Bytes per element of the expert stacks where they differ from the model dtype's (bits: 2)."""
    return jnp.dtype(BF16_BITS).itemsize if bf16_bits_stacks(params) else None


def bf16_experts_note(params: dict) -> str:
    """The start-up report's word on experts kept as bfloat16 bits, else empty."""
    stacks = bf16_bits_stacks(params)
    if not stacks:
        return ""
    size = sum(w.nbytes for w in stacks) / 2**20
    return (f"; MoE experts kept as the checkpoint's bfloat16: {size:.1f} MiB, half of float32's "
            f"(--dtype float32 keeps float32)")
