"""Sleep, wake and pause (vLLM's names and semantics), for RL loops that share the device with a trainer.

    sleep(level=1, mode="abort")   pause (mode: what happens to the requests in flight), then free the
                                   KV pool and take the weights off the device: level 1 keeps a numpy
                                   host copy, level 2 keeps nothing (the next update_weights brings
                                   them back; until then generating is an EngineSleepingError)
    wake_up(tags=None)             "weights" then "kv_cache" (None: both): the pool can be allocated
                                   after new weights are in; once both are back, generation resumes
    pause_generation(mode)         abort: in-flight requests end (finish_reason "abort");
                                   wait: they run to the end; keep: they stay where they are, no step
                                   runs. New requests wait (held) until resume_generation().

Nothing recompiles on wake: every array comes back with its shape, dtype and sharding (an array
placed by default is placed by default again), so every compiled step program still applies. While
asleep, each weight leaf of the runner's and the model's params is a `jax.ShapeDtypeStruct` with the
served sharding (what update_weights places new weights on); the device arrays the engine owns are
deleted, so their memory goes back at once (ones the caller passed in are only dropped: another
engine may hold them). Requests kept across a sleep lose their KV: they are recomputed on wake,
as a preemption would do. `SleepMixin` is LLMEngine's side (its thread); AsyncLLM's async calls are
engine/async_sleep.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.request import Request, RequestStatus
from jaxserve.engine.exceptions import EngineSleepingError
from jaxserve.models.expert_weights import LAYER_VIEWS, with_layer_views

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")


def check_sleep_args(level: int | None = None, mode: str | None = None, tags: list[str] | None = None) -> None:
    """ValueError naming the argument for a level, mode or tag vLLM does not have."""
    if level is not None and (isinstance(level, bool) or level not in (1, 2)):
        raise ValueError(f"level: must be 1 (weights to host memory) or 2 (weights dropped), got {level!r}")
    if mode is not None and mode not in PAUSE_MODES:
        raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    if tags is not None:
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise ValueError(f"tags: expected a list of tags among {', '.join(WAKE_TAGS)}, got {tags!r}")
        bad = next((t for t in tags if t not in WAKE_TAGS), None)
        if bad is not None:
            raise ValueError(f"tags: must be among {', '.join(WAKE_TAGS)}, got {bad!r}")


# ---- arrays off the device and back -----------------------------------------------------------------
@dataclass
class Offloaded:
    """Where a tree's arrays went: numpy host copies by leaf path (level 1's; absent: dropped), and
    which leaves were placed by default (uncommitted): restored the same way, or jit would see a new
    input placement and compile again."""
    host: dict[str, np.ndarray] = field(default_factory=dict)
    uncommitted: set[str] = field(default_factory=set)


def placeholder(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x


def offload(tree: Any, keep: Callable[[str], bool], delete: bool) -> tuple[Any, Offloaded]:
    """`tree` with its arrays replaced by placeholders; a host copy of each leaf whose path `keep`s.
    `delete`: the arrays are the engine's own, so their buffers are freed now."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    saved, out = Offloaded(), []
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        if isinstance(x, jax.Array):
            if keep(name):  # a copy of its own: on a CPU the array's numpy view aliases the buffer freed below
                saved.host[name] = np.array(x, copy=True)
            if not getattr(x, "_committed", True):
                saved.uncommitted.add(name)
            if delete and not x.is_deleted():
                x.delete()
        out.append(placeholder(x))
    return jax.tree_util.tree_unflatten(treedef, out), saved


def restore(tree: Any, saved: Offloaded) -> Any:
    """`tree` with each placeholder that has a host copy put back on its sharding (leaves already
    replaced, by an update made while asleep, are kept)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        if isinstance(x, jax.ShapeDtypeStruct) and name in saved.host:
            host = saved.host[name]
            x = jax.device_put(host) if name in saved.uncommitted else jax.device_put(host, x.sharding)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def has_placeholders(tree: Any) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def zeros_program(spec: jax.ShapeDtypeStruct) -> Callable[[], jax.Array]:
    """What makes a zeroed array on `spec`'s sharding again at wake, compiling nothing then: on one
    device the start-up pool's own jnp.zeros (compiled for that shape already), placed; on a mesh a
    program compiled now, when the pool is freed (the first sleep only: the state keeps it)."""
    if isinstance(spec.sharding, jax.sharding.SingleDeviceSharding):
        return lambda: jax.device_put(jnp.zeros(spec.shape, spec.dtype), spec.sharding)
    make = jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=spec.sharding)
    return make.lower().compile()


def without_views(params: dict) -> dict:
    """The runner's params less a MoE stack's per-layer views (they alias the stacks: re-made at wake)."""
    layers = params.get("layers")
    if not isinstance(layers, dict) or LAYER_VIEWS not in layers:
        return params
    return {**params, "layers": {k: v for k, v in layers.items() if k != LAYER_VIEWS}}


def project(template: Any, full: Any) -> Any:
    """`full`'s values in `template`'s dict structure (the model's params inside the runner's, which
    adds LoRA slots)."""
    if isinstance(template, dict):
        return {k: project(v, full[k]) for k, v in template.items()}
    return full


@dataclass
class SleepState:
    weights_asleep: bool = False  # the weights are off the device
    kv_asleep: bool = False  # the KV pool is freed
    level: int = 0  # the last sleep's level while asleep
    weights: Offloaded | None = None
    kv: Offloaded | None = None
    kv_zeros: dict[str, Callable[[], jax.Array]] = field(default_factory=dict)  # committed pool leaves' programs
    had_views: bool = False  # the runner's params carried LAYER_VIEWS
    weights_dropped: bool = False  # level 2: some weight is a placeholder until an update brings it
    paused: str | None = None  # the pause mode, None when generating
    paused_by_sleep: bool = False  # wake_up resumes what sleep paused
    clear_cache: bool = False  # empty the prefix cache on resume
    held: list[Request] = field(default_factory=list)  # requests added while paused

    @property
    def asleep(self) -> bool:
        return self.weights_asleep or self.kv_asleep


class SleepMixin:
    """LLMEngine's sleep / wake / pause (the attributes are LLMEngine's)."""

    @property
    def _sleep(self) -> SleepState:
        return self.__dict__.setdefault("_sleep_state", SleepState())

    def is_sleeping(self) -> bool:
        return self._sleep.asleep

    def is_paused(self) -> bool:
        return self._sleep.paused is not None

    # ---- pause ------------------------------------------------------------------------------------
    def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> list:
        """Stop scheduling (vLLM's pause_generation): abort ends every request now (their outputs,
        finish_reason "abort", are returned); wait lets them run to the end (step() goes on for them
        alone); keep leaves them where they are and step() runs nothing. Requests added meanwhile
        wait for resume_generation(). `clear_cache`: empty the prefix cache on resume (not for keep)."""
        check_sleep_args(mode=mode)
        self._check_open()
        st = self._sleep
        st.paused = mode
        st.clear_cache = st.clear_cache or (clear_cache and mode != "keep")
        return self.abort_request(self.request_ids()) if mode == "abort" else []

    def resume_generation(self) -> None:
        """Schedule again: kept requests continue, held ones are admitted (oldest first)."""
        self._check_open()
        st = self._sleep
        if st.asleep:
            raise EngineSleepingError("resume_generation: the engine is asleep; wake_up() resumes it")
        if st.clear_cache:
            self.scheduler.kv.block_pool.reset_prefix_cache()
        alive = {s.child_id for g in self.outputs.groups.values() for s in g.samples}
        held, st.held = st.held, []
        st.paused, st.paused_by_sleep, st.clear_cache = None, False, False
        for req in held:  # (an aborted one is no longer in a group)
            if req.request_id in alive:
                self.scheduler.add_request(req)

    def _admit(self, req: Request) -> None:
        """A new scheduler request: scheduled, or held while generation is paused."""
        st = self.__dict__.get("_sleep_state")
        if st is not None and st.paused is not None:
            st.held.append(req)
        else:
            self.scheduler.add_request(req)

    # ---- what may run -------------------------------------------------------------------------------
    @property
    def generation_blocked(self) -> bool:
        """step() runs nothing: paused (abort, keep), asleep, or weights dropped and not yet replaced."""
        st = self.__dict__.get("_sleep_state")
        return st is not None and (st.paused in ("abort", "keep") or st.asleep or self.weights_missing())

    def weights_missing(self) -> bool:
        """After sleep(level=2) and wake_up: True until update_weights has replaced every weight."""
        st = self.__dict__.get("_sleep_state")
        if st is None or not st.weights_dropped or st.weights_asleep:
            return False
        return has_placeholders(self.runner.params)

    def can_step(self) -> bool:
        """Whether step() has work it may run now (AsyncLLM's loop steps only then)."""
        if not self.has_unfinished_requests() or self.generation_blocked:
            return False
        st = self.__dict__.get("_sleep_state")
        if st is not None and st.paused == "wait":  # only the requests admitted before the pause run
            return not self.drained()
        self._after_update()
        return True

    def drained(self) -> bool:
        """No scheduled request and no step in flight (pause mode wait is done)."""
        return not self.scheduler.has_unfinished_requests() and not self._in_flight

    def check_can_generate(self) -> None:
        """EngineSleepingError saying why a blocking generate() would never finish now."""
        if self.is_sleeping():
            raise EngineSleepingError("generate: the engine is asleep (sleep() was called); call wake_up() first")
        self.check_has_weights()
        self._after_update()
        if self.is_paused():
            raise EngineSleepingError("generate: generation is paused (pause_generation()); call "
                                      "resume_generation() first")

    def check_has_weights(self) -> None:
        st = self.__dict__.get("_sleep_state")
        if st is not None and st.weights_dropped and not st.weights_asleep and has_placeholders(self.runner.params):
            raise EngineSleepingError("generate: the weights were discarded by sleep(level=2); load new ones "
                                      "with update_weights() (or POST /update_weights_from_disk) first")

    def _blocked_step(self) -> list:
        """step() while blocked: an error if it can never run as things are, else nothing (paused)."""
        if self.is_sleeping():
            raise EngineSleepingError("step: the engine is asleep; call wake_up() first")
        self.check_has_weights()
        return []

    def _after_update(self) -> None:
        """Once an update has replaced every weight dropped by level 2: the MoE views come back."""
        st = self.__dict__.get("_sleep_state")
        if st is not None and st.weights_dropped and not st.weights_asleep and not self.weights_missing():
            st.weights_dropped = False
            if st.had_views and LAYER_VIEWS not in self.runner.params["layers"]:
                self.runner.params = {**self.runner.params,
                                      "layers": with_layer_views(self.runner.params["layers"])}

    # ---- sleep and wake -------------------------------------------------------------------------------
    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> list:
        """Pause (`mode`), then free the KV pool and take the weights off the device (level 1: to host
        memory; level 2: dropped). Returns the outputs of requests that ended meanwhile."""
        check_sleep_args(level=level, mode=mode)
        self._check_sleep_supported()
        st = self._sleep
        outputs = self._pause_for_sleep(mode)
        if mode == "wait" and not st.asleep:  # (asleep already: nothing can run, nothing to wait for)
            while not self.drained():
                outputs += self.step()
        outputs += self._finish_in_flight()
        self._preempt_running()
        self.scheduler.kv.block_pool.reset_prefix_cache()  # its blocks' KV is about to go
        if not st.kv_asleep:
            self._release_kv()
        if not st.weights_asleep or (level == 2 and st.weights is not None and st.weights.host):
            self._release_weights(level)
        st.level = max(st.level, level)
        return outputs

    def _pause_for_sleep(self, mode: PauseMode) -> list:
        """sleep()'s pause: wake_up() resumes it unless the caller had paused first. An explicit pause
        stays as it is under mode keep; abort and wait apply to it."""
        st = self._sleep
        if st.paused is None:
            st.paused_by_sleep = True
        return self.pause_generation(mode) if st.paused is None or mode != "keep" else []

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights ("weights") and the KV pool ("kv_cache"); None: both. Once both are
        back, what sleep() paused resumes. After level 2 the weights stay missing until update_weights."""
        check_sleep_args(tags=tags)
        self._check_open()
        st = self._sleep
        tags = list(WAKE_TAGS) if tags is None else tags
        if "weights" in tags and st.weights_asleep:
            self._restore_weights()
        if "kv_cache" in tags and st.kv_asleep:
            runner = self.runner
            flat, treedef = jax.tree_util.tree_flatten_with_path(runner.kv)
            leaves = [st.kv_zeros[n]() if n in st.kv_zeros else jnp.zeros(x.shape, x.dtype)
                      for n, x in ((jax.tree_util.keystr(p), x) for p, x in flat)]
            runner.kv, st.kv, st.kv_asleep = jax.tree_util.tree_unflatten(treedef, leaves), None, False
        if not st.asleep:
            st.level = 0
            if st.paused_by_sleep:
                self.resume_generation()

    def _check_sleep_supported(self) -> None:
        self._check_open()
        if self.pipeline is not None:
            raise ValueError("pipeline_parallel_size: sleep does not cover pipeline stages; use tensor_parallel_size")
        if self.args.num_hosts > 1 or getattr(self.runner, "multi_process", False):
            raise ValueError("num_hosts: sleep runs in one process; this engine spans several")
        if self.config is None or getattr(self.runner, "kv", None) is None:
            raise ValueError("runner: sleep frees a paged runner's KV pool and weights; an encoder (pooling) "
                             "model has no such runner")

    def _finish_in_flight(self) -> list:
        """Read back every step in flight (async scheduling) before their buffers go."""
        outputs = []
        while self._in_flight:
            done, pending = self._in_flight.popleft()
            outputs += self._update(done, pending.result())
        return outputs

    def _preempt_running(self) -> None:
        """Kept requests lose their KV with the pool: back to the front of the waiting queue (oldest
        first), recomputed on wake as a preemption would (their tokens so far are kept)."""
        sched = self.scheduler
        running, sched.running = list(sched.running), []
        for req in reversed(running):
            sched.kv.free(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            sched.waiting.appendleft(req)

    def _release_kv(self) -> None:
        st, runner = self._sleep, self.runner
        jax.block_until_ready(runner.kv)  # (a step's writes into it are done)
        runner.kv, st.kv = offload(runner.kv, keep=lambda name: False, delete=True)
        flat = jax.tree_util.tree_flatten_with_path(runner.kv)[0]
        for path, spec in flat:
            name = jax.tree_util.keystr(path)
            if name not in st.kv.uncommitted and name not in st.kv_zeros:
                st.kv_zeros[name] = zeros_program(spec)
        st.kv_asleep = True

    def _release_weights(self, level: int) -> None:
        """Placeholders in the runner's and the model's params; level 1 keeps host copies of every
        array, level 2 only of what the runner adds (LoRA slots: not weights an update brings back)."""
        st, runner = self._sleep, self.runner
        params = without_views(runner.params)
        st.had_views = st.had_views or params is not runner.params
        runner.params = params  # the views alias the stacks: dropped before the stacks go
        model_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.model.params)[0]}
        if st.weights_asleep:  # level 1 before: drop the host copies of the weights
            st.weights.host = {k: v for k, v in st.weights.host.items() if k not in model_paths}
        else:
            keep = (lambda name: True) if level == 1 else (lambda name: name not in model_paths)
            placeholders, st.weights = offload(params, keep, delete=self._owns_weights)
            runner.params = placeholders
            self.model = dataclasses.replace(self.model, params=project(self.model.params, placeholders))
        st.weights_asleep = True
        st.weights_dropped = st.weights_dropped or level == 2

    def _restore_weights(self) -> None:
        st, runner = self._sleep, self.runner
        params = restore(runner.params, st.weights)
        self.model = dataclasses.replace(self.model, params=project(self.model.params, params))
        if st.had_views and not has_placeholders(params):
            params = {**params, "layers": with_layer_views(params["layers"])}
        runner.params, st.weights, st.weights_asleep = params, None, False
        if not has_placeholders(params):
            st.weights_dropped = False
