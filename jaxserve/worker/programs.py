"""The jitted programs of a step, and the compilation counter that proves serving compiles nothing
after warm-up.

    model_step[T, decode_only]  (params, kv donated, batch, rows, prev_tokens) -> kv, hidden [P], hidden [T]
    sample_step[S, variant]     (params, hidden, sampling metadata) -> SamplerOutput, ids padded to [P]
    prompt_logprobs_step        logprob, rank and top-N of prompt tokens at Q positions
    copy_blocks / gather_blocks / scatter_blocks   block copies and swaps on the pool (donated)

Each engine owns its programs (`StepPrograms`, one per ModelRunner): jax.jit wrappers of fresh
function objects, so JAX's in-memory caches, which are keyed on the function object, hold this
engine's executables only while the engine lives, and `release()` drops them at once. An XLA:CPU
executable maps its code into the process (about 130 memory maps a program, ~4,800 an engine's
warm-up); shared module-level programs had kept every configuration's alive until the process
reached vm.max_map_count (65,530) and the next compilation crashed. A second engine of the same
model and shapes loads its programs from the persistent compilation cache (on disk) instead.
The module-level `_model_step`, `_sample_step`, ... are the same programs for tests and scripts.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring
from jax.experimental import multihost_utils

from jaxserve.parallel.jit import fresh_jit
from jaxserve.models import llama
from jaxserve.sample.sampler import (SLICED_MIN_ROWS, SamplerOutput, compute_logprobs, plain_greedy, sample,
                                     sample_greedy_in_slices)
from jaxserve.sample.sampling_metadata import SamplingMetadata
from jaxserve.worker.input_batch import StepInput
from jaxserve.worker.lm_head import head_logits, head_slice_logits

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


def _model_step_fn(params, kv, batch: StepInput, rows, prev_tokens, *, cfg, backend, bf16_dots_from=0):
    # prev_tokens [P] i32: the previous step's sampled ids, still on the device (async scheduling)
    token_ids = jnp.where(batch.prev_rows >= 0, prev_tokens[jnp.maximum(batch.prev_rows, 0)], batch.token_ids)
    kv, hidden = llama.forward(params, cfg, kv, token_ids, batch.positions, batch.attn, backend, bf16_dots_from,
                               batch.lora_slots, batch.mm_embeds, batch.mm_mask)
    return kv, hidden[rows], hidden  # [P, hidden]: the sampling tokens' last positions; [T, hidden]: all


def _rows_like_fn(hidden, num_tokens):  # [T, hidden] -> zeros [num_tokens, hidden], placed as a step's output
    return jnp.broadcast_to(hidden[:1] * 0, (num_tokens, *hidden.shape[1:]))


def _gather_rows_fn(hidden, rows):  # [T, hidden], [Q] -> [Q, hidden]; compiled per token bucket, tiny
    return hidden[rows]


def _prompt_logprobs_step_fn(params, hidden, targets, *, logit_softcap: float | None = None) -> SamplerOutput:
    """Logprob, rank and top-N of the next prompt token at Q prompt positions (logit_softcap: the
    model's final logit soft-capping, ModelConfig.final_logit_softcap)."""
    return compute_logprobs(llama.compute_logits(params, hidden, logit_softcap), targets)


def _sample_step_fn(params, hidden, md: SamplingMetadata, *, num_rows: int, vocab_slices: int = 0,
                 head_dots: bool = False, logit_softcap: float | None = None, logprobs_mode: str = "raw_logprobs",
                 head_float32: bool = False) -> tuple[SamplerOutput, jax.Array]:
    """The sampler's output, and its token ids padded to [num_rows] (P) for the next step's inputs.
    vocab_slices > 0 (the runner's choice: CPU, one device, a float or int8 head): a step of at least
    SLICED_MIN_ROWS plain greedy rows takes the head a vocabulary slice at a time (a lax.cond, the
    same program). head_dots (the CPU's bfloat16 dots, engine/config.py): those slices at every row
    count, each a bfloat16 dot accumulated in float32 (1.5x float32's slices at 32-64 rows on a
    Zen 4); other batches take the whole head in float32. logprobs_mode, head_float32: the engine's
    --logprobs-mode and --head-dtype float32 (sampler.sample, worker/lm_head.py)."""
    hidden = hidden[: md.temperature.shape[0]]  # LM head on S rows only
    dots = jnp.bfloat16 if head_dots else None

    def full():
        return sample(head_logits(params, hidden, head_float32, logit_softcap), md, logprobs_mode)

    def sliced():
        return sample_greedy_in_slices(hidden.shape[0], params["embed"].shape[0], vocab_slices,
                                       lambda start, size: head_slice_logits(params, hidden, start, size,
                                                                             head_float32, dots, logit_softcap),
                                       normalize=logprobs_mode.endswith("logprobs"))

    if (vocab_slices and (head_dots or hidden.shape[0] >= SLICED_MIN_ROWS) and md.all_greedy
            and not md.use_penalties):
        so = jax.lax.cond(plain_greedy(md), sliced, full)
    else:
        so = full()
    return so, jnp.zeros((num_rows,), jnp.int32).at[: so.token_ids.shape[0]].set(so.token_ids)


def _copy_blocks_fn(kv, src, dst):  # dst == num_blocks (out of range) for padding pairs
    return tuple(c.at[:, :, dst].set(c[:, :, src], mode="drop") for c in kv)


def _gather_blocks_fn(kv, ids):
    return tuple(c[:, :, ids] for c in kv)


def _scatter_blocks_fn(kv, ids, k, v):
    return kv[0].at[:, :, ids].set(k, mode="drop"), kv[1].at[:, :, ids].set(v, mode="drop")


# name -> (function, jax.jit keywords). The model config is a static argument of the model step.
_PROGRAMS = {
    "model_step": (_model_step_fn, dict(static_argnames=("cfg", "backend", "bf16_dots_from"), donate_argnums=1)),
    "rows_like": (_rows_like_fn, dict(static_argnums=1)),
    "gather_rows": (_gather_rows_fn, {}),
    "prompt_logprobs_step": (_prompt_logprobs_step_fn, dict(static_argnames=("logit_softcap",))),
    "sample_step": (_sample_step_fn, dict(static_argnames=("num_rows", "vocab_slices", "head_dots", "logit_softcap",
                                                         "logprobs_mode", "head_float32"))),
    "copy_blocks": (_copy_blocks_fn, dict(donate_argnums=0)),
    "gather_blocks": (_gather_blocks_fn, {}),
    "scatter_blocks": (_scatter_blocks_fn, dict(donate_argnums=0)),
}


class StepPrograms:
    """One engine's programs (attributes named as `_PROGRAMS`); `release()` frees their executables."""

    def __init__(self) -> None:
        self._names = list(_PROGRAMS)
        for name, (fn, kw) in _PROGRAMS.items():
            setattr(self, name, fresh_jit(fn, **kw))

    def release(self) -> None:
        for name in self._names:
            program = self.__dict__.pop(name, None)
            if program is not None:
                program.clear_cache()
        self._names = []


# The same programs at module level, for tests and scripts (an engine uses its own StepPrograms).
_model_step, _rows_like, _gather_rows, _prompt_logprobs_step, _sample_step, _copy_blocks, _gather_blocks, \
    _scatter_blocks = (jax.jit(fn, **kw) for fn, kw in _PROGRAMS.values())


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
