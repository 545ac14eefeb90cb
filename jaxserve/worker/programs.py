"""The jitted programs of a step, module-level so engines of the same model and shapes in one
process (tests, `bench sweep`) share compiled executables, and the compilation counter that
proves serving compiles nothing after warm-up.

    _model_step[T, decode_only]  (params, kv donated, batch, rows, prev_tokens) -> kv, hidden [P], hidden [T]
    _sample_step[S, variant]     (params, hidden, sampling metadata) -> SamplerOutput, ids padded to [P]
    _prompt_logprobs_step        logprob, rank and top-N of prompt tokens at Q positions
    _copy_blocks / _gather_blocks / _scatter_blocks   block copies and swaps on the pool (donated)
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring
from jax.experimental import multihost_utils

from jaxserve.models import llama
from jaxserve.sample.sampler import (SLICED_MIN_ROWS, SamplerOutput, compute_logprobs, plain_greedy, sample,
                                     sample_greedy_in_slices)
from jaxserve.sample.sampling_metadata import SamplingMetadata
from jaxserve.worker.input_batch import StepInput

_compile_lock = threading.Lock()
_num_compilations = 0


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _num_compilations
    if event == "/jax/core/compile/backend_compile_duration":
        with _compile_lock:
            _num_compilations += 1


monitoring.register_event_duration_secs_listener(_on_event)


def num_compilations() -> int:
    """XLA backend compilations in this process so far (persistent-cache hits are not compilations)."""
    return _num_compilations


# The model config is a static argument: one executable per (config, shapes).
@functools.partial(jax.jit, static_argnames=("cfg", "backend", "bf16_dots_from"), donate_argnums=1)
def _model_step(params, kv, batch: StepInput, rows, prev_tokens, *, cfg, backend, bf16_dots_from=0):
    # prev_tokens [P] i32: the previous step's sampled ids, still on the device (async scheduling)
    token_ids = jnp.where(batch.prev_rows >= 0, prev_tokens[jnp.maximum(batch.prev_rows, 0)], batch.token_ids)
    kv, hidden = llama.forward(params, cfg, kv, token_ids, batch.positions, batch.attn, backend, bf16_dots_from,
                               batch.lora_slots)
    return kv, hidden[rows], hidden  # [P, hidden]: the sampling tokens' last positions; [T, hidden]: all


@functools.partial(jax.jit, static_argnums=1)
def _rows_like(hidden, num_tokens):  # [T, hidden] -> zeros [num_tokens, hidden], placed as a step's output
    return jnp.broadcast_to(hidden[:1] * 0, (num_tokens, *hidden.shape[1:]))


@jax.jit
def _gather_rows(hidden, rows):  # [T, hidden], [Q] -> [Q, hidden]; compiled per token bucket, tiny
    return hidden[rows]


@jax.jit
def _prompt_logprobs_step(params, hidden, targets) -> SamplerOutput:
    """Logprob, rank and top-N of the next prompt token at Q prompt positions."""
    return compute_logprobs(llama.compute_logits(params, hidden), targets)


@functools.partial(jax.jit, static_argnames=("num_rows", "vocab_slices", "head_dots"))
def _sample_step(params, hidden, md: SamplingMetadata, *, num_rows: int, vocab_slices: int = 0,
                 head_dots: bool = False) -> tuple[SamplerOutput, jax.Array]:
    """The sampler's output, and its token ids padded to [num_rows] (P) for the next step's inputs.
    vocab_slices > 0 (the runner's choice: CPU, one device, a float or int8 head): a step of at least
    SLICED_MIN_ROWS plain greedy rows takes the head a vocabulary slice at a time (a lax.cond, the
    same program). head_dots (the CPU's bfloat16 dots, engine/config.py): those slices at every row
    count, each a bfloat16 dot accumulated in float32 (1.5x float32's slices at 32-64 rows on a
    Zen 4); other batches take the whole head in float32."""
    hidden = hidden[: md.temperature.shape[0]]  # LM head on S rows only
    dots = jnp.bfloat16 if head_dots else None

    def full():
        return sample(llama.compute_logits(params, hidden), md)

    def sliced():
        return sample_greedy_in_slices(hidden.shape[0], params["embed"].shape[0], vocab_slices,
                                       lambda start, size: llama.slice_logits(params, hidden, start, size, dots))

    if (vocab_slices and (head_dots or hidden.shape[0] >= SLICED_MIN_ROWS) and md.all_greedy
            and not md.use_penalties):
        so = jax.lax.cond(plain_greedy(md), sliced, full)
    else:
        so = full()
    return so, jnp.zeros((num_rows,), jnp.int32).at[: so.token_ids.shape[0]].set(so.token_ids)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_blocks(kv, src, dst):  # dst == num_blocks (out of range) for padding pairs
    return tuple(c.at[:, :, dst].set(c[:, :, src], mode="drop") for c in kv)


@jax.jit
def _gather_blocks(kv, ids):
    return tuple(c[:, :, ids] for c in kv)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_blocks(kv, ids, k, v):
    return kv[0].at[:, :, ids].set(k, mode="drop"), kv[1].at[:, :, ids].set(v, mode="drop")


def _fetch(tree):
    """Device outputs to host numpy. An array spread over several processes' devices is read
    from this process's replica when fully replicated, else all-gathered (a collective that
    every process runs, as every process runs the same `run`)."""
    leaves = jax.tree.leaves(tree)
    if all(x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)

    def one(x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)
