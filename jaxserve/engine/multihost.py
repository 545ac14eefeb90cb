"""Many hosts, one replica: JAX's multi-controller model behind one server.

Every process runs this same code; `jax.distributed` joins them and `jax.devices()`
then lists every host's devices, so the engine's mesh (and the sharded weights and
KV pool on it) spans all of them: one tensor-parallel mesh, or pipeline stages (a
stage per host, each stage's devices its own TP mesh; parallel/pipeline.py). Each jitted program must be issued by every
process, in the same order, with the same host inputs; so only rank 0 schedules:

    rank 0: HTTP server, scheduler, LLMEngine.step()
              runner.prepare(sched_out) -> PreparedStep ---(key-value store)---+
              runner.run(prepared)  <- the collectives meet ->                 |
    rank r:                                 runner.run(prepared)  <-----------+  (loop until STOP)

Start-up (loading, KV sizing, warm-up) is identical on every rank: each builds the
same LLMEngine from the same flags (checked against rank 0's), so the warm-up programs
line up without messages. A PreparedStep is plain numpy and ints; it travels through
jax.distributed's own key-value store (the coordinator rank 0 already runs), one key
per (receiver, step), deleted by the receiver, so nothing accumulates. A step that writes
LoRA adapters into device slots names them (id, name, path): only rank 0 serves names, so
every other rank reads the adapter from the same path on its own host (as rank 0 did) and
keeps it under the same id. The message is encoded as
typed arrays (parallel/host_channel.py), never a pickle: a payload planted in the store
is refused, not run. The coordinator binds to the --coordinator address only. Each worker
beats in the store every second; rank 0 fails its steps and exits when one is silent for
HEARTBEAT_TIMEOUT_S (killed, hung, or its host gone), and a worker whose coordinator is
gone exits too.
"""

from __future__ import annotations

import dataclasses
import logging
import inspect
import os
import threading
import time
from typing import Any

import jax

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.lora.request import LoRARequest
from jaxserve.worker.model_runner import ModelRunner, PreparedStep
from jaxserve.core.scheduler_output import ModelOutput, SchedulerOutput
from jaxserve.models.attention import AttentionMetadata
from jaxserve.parallel.host_channel import Heartbeat, Pulse, StepCodec, Watchdog
from jaxserve.sample.sampling_metadata import SamplingMetadata
from jaxserve.worker.input_batch import StepInput
from jaxserve.worker.model_runner import PromptLogprobChunk

log = logging.getLogger(__name__)
_PREFIX = "jaxserve"
_POLL_MS = 1000  # a worker's wait for the next step is re-armed this often (the server may idle for hours)
HEARTBEAT_TIMEOUT_S = 10.0  # a worker silent this long is lost: rank 0 fails its steps and exits
EXIT_GRACE_S = 5.0  # after that, time for the failed step's errors to reach the clients before rank 0 exits
EXIT_WORKER_LOST = 3  # rank 0's exit status when a worker was lost
_heartbeats: list[Heartbeat] = []  # this process's (stopped when the run ends)


@dataclasses.dataclass(frozen=True)
class StepMessage:
    """One step for the other ranks: the step, and (lora id, name, path) of each adapter it writes
    into a LoRA slot (a worker that has not seen the id yet reads it from the path)."""
    step: PreparedStep
    adapters: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)


# Everything a step message may hold (the decoder builds these types and no others).
CODEC = StepCodec([StepMessage, PreparedStep, PromptLogprobChunk, StepInput, AttentionMetadata,
                   SamplingMetadata])


def is_enabled(args: EngineArgs) -> bool:
    """--num-hosts > 1, --coordinator, or the standard JAX_COORDINATOR_ADDRESS environment variable."""
    return args.num_hosts > 1 or args.coordinator is not None or "JAX_COORDINATOR_ADDRESS" in os.environ


def initialize(args: EngineArgs) -> None:
    """jax.distributed.initialize from the flags (unset ones from JAX's cluster detection). Must run
    before anything touches a JAX backend; on CPU the collectives go over gloo (TCP)."""
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The coordinator listens on the address it was given, not JAX's default of every interface.
    bind = {"coordinator_bind_address": args.coordinator} if args.coordinator and \
        "coordinator_bind_address" in inspect.signature(jax.distributed.initialize).parameters else {}
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_hosts if args.num_hosts > 1 else None,
                               process_id=args.host_rank, **bind)
    # Every rank beats from here on (through loading and warm-up too): rank 0 watches the workers'
    # beats, the workers rank 0's. Stopped by stop_workers / follow's end.
    _heartbeats.append(Heartbeat(_client(), jax.process_index()))
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized; call multihost.initialize(args) first")
    return client


class StepChannel:
    """Rank 0 -> every other rank: one typed message per step through the key-value store."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.client, self.rank, self.num_ranks = _client(), jax.process_index(), jax.process_count()
        self.timeout_s = timeout_s  # a worker's longest wait for one message; None: forever
        self.leader = Pulse(self.client, 0)
        self.seq = 0

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/step/{rank}/{self.seq}"

    def send(self, msg: StepMessage | None) -> None:
        data = CODEC.encode(msg)
        for rank in range(1, self.num_ranks):
            self.client.key_value_set_bytes(self._key(rank), data)
        self.seq += 1

    def recv(self) -> StepMessage | None:
        key, start = self._key(self.rank), time.monotonic()
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except jax.errors.JaxRuntimeError as e:
                waited = time.monotonic() - start
                if "DEADLINE_EXCEEDED" not in str(e) or (self.timeout_s is not None and waited > self.timeout_s):
                    raise
                # rank 0 killed or hung: its beat stops (or its coordinator is gone: this raises)
                if (silent := self.leader.silent_s()) > HEARTBEAT_TIMEOUT_S:
                    raise RuntimeError(f"host rank 0 stopped responding ({silent:.0f} s without a heartbeat)") from None
        self.client.key_value_delete(key)
        self.seq += 1
        msg = CODEC.decode(data)  # ValueError for anything but a typed step: never unpickled
        if msg is not None and not isinstance(msg, StepMessage):
            raise ValueError(f"not a jaxserve typed step: a {type(msg).__name__} where a StepMessage goes")
        return msg


class LeaderRunner:
    """Rank 0's runner: prepares each step, sends it to the other ranks, then runs it itself.
    Steps with no device work (an idle engine) are not sent: the workers have nothing to match."""

    def __init__(self, runner: ModelRunner, channel: StepChannel,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.runner, self.channel = runner, channel
        self.num_steps_sent = 0
        self.lost: str | None = None  # why the run is over (a worker lost), once it is
        self.watchdog = Watchdog(channel.client, range(1, channel.num_ranks), heartbeat_timeout_s, self._on_lost)

    def _on_lost(self, rank: int, silent_s: float) -> None:
        """A worker is gone: every later step fails (the engine loop ends its requests with errors); a
        step stuck in a collective with it cannot return, so the process exits after a grace period."""
        self.lost = f"host rank {rank} stopped responding ({silent_s:.0f} s without a heartbeat)"
        log.error("%s; failing every request and exiting in %.0f s", self.lost, EXIT_GRACE_S)
        threading.Timer(EXIT_GRACE_S, os._exit, (EXIT_WORKER_LOST,)).start()

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        if self.lost is not None:
            raise RuntimeError(self.lost)
        prepared = self.runner.prepare(out)
        if not prepared.has_device_work:
            return ModelOutput()
        self.channel.send(StepMessage(prepared, self._adapters(prepared)))
        self.num_steps_sent += 1
        return self.runner.run(prepared)  # synchronous: async scheduling is off with num_hosts > 1

    def _adapters(self, prepared: PreparedStep) -> list[tuple[int, str, str]]:
        """(id, name, path) of the adapters the step writes into slots (the workers' managers know
        only the ids rank 0 has sent them)."""
        lora = self.runner.lora
        requests = [lora.request(lora_id) for _, lora_id in prepared.lora_writes if lora_id]
        return [(r.lora_int_id, r.lora_name, r.lora_path) for r in requests]

    def stop_workers(self) -> None:
        self.watchdog.stop()
        _stop_heartbeats()
        if self.lost is None:
            self.channel.send(None)

    def __getattr__(self, name: str) -> Any:  # kv, rc, warmup, ...: the wrapped runner's
        return getattr(self.runner, name)


def _stop_heartbeats() -> None:
    while _heartbeats:
        _heartbeats.pop().stop()


def _agree(tag: str, value: object) -> None:
    """Raise on a rank whose `value` differs from rank 0's: every rank must build the same engine,
    or their programs would not line up (a hang, or silently wrong collectives)."""
    client, rank = _client(), jax.process_index()
    key = f"{_PREFIX}/agree/{tag.replace(' ', '_')}"
    if rank == 0:
        client.key_value_set(key, repr(value), allow_overwrite=True)
        return
    theirs = client.blocking_key_value_get(key, 600_000)
    if theirs != repr(value):
        raise ValueError(f"host rank {rank}: {tag} differs from rank 0's; start every host with the same "
                         f"flags and model.\n  rank 0: {theirs}\n  rank {rank}: {value!r}")


def _build_engine(args: EngineArgs, progress: bool) -> LLMEngine:
    """The same LLMEngine on every rank: one tensor-parallel mesh over every host's devices."""
    if args.data_parallel_size > 1:
        raise ValueError("data_parallel_size: with --num-hosts > 1 the hosts form one replica; "
                         "run one multi-host deployment per replica instead")
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if tp * pp != jax.device_count():
        raise ValueError(f"tensor_parallel_size: {jax.process_count()} hosts with {jax.device_count()} devices "
                         f"in all need --tensor-parallel-size x --pipeline-parallel-size = {jax.device_count()} "
                         f"(every device in the replica); got {tp} x {pp}")
    _agree("engine arguments", dataclasses.replace(args, host_rank=None))
    engine = LLMEngine(args, progress=progress and is_leader())
    _agree("runner config", engine.runner.rc)
    return engine


def leader_engine(args: EngineArgs, progress: bool = True,
                  heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> LLMEngine:
    """Rank 0: an LLMEngine whose steps are mirrored on every other rank. Call `stop_workers`
    when done, or the workers wait for the next step until their timeout."""
    if not is_leader():
        raise RuntimeError(f"leader_engine on host rank {jax.process_index()}; only rank 0 schedules")
    engine = _build_engine(args, progress)
    engine.runner = LeaderRunner(engine.runner, StepChannel(), heartbeat_timeout_s)
    return engine


def stop_workers(engine: LLMEngine) -> None:
    """Tell the other ranks the run is over (no-op for a single-host engine)."""
    if isinstance(engine.runner, LeaderRunner):
        engine.runner.stop_workers()


def worker_engine(args: EngineArgs) -> LLMEngine:
    """Ranks > 0: the same engine as rank 0's (its scheduler stays idle)."""
    if is_leader():
        raise RuntimeError("worker_engine on host rank 0; rank 0 runs the scheduler (leader_engine)")
    return _build_engine(args, progress=False)


def follow(engine: LLMEngine, timeout_s: float | None = None) -> int:
    """Run every step rank 0 sends until it says stop; returns how many ran.
    `timeout_s`: the longest wait for one step (None: forever, as a server may idle)."""
    channel = StepChannel(timeout_s)
    num_steps = 0
    while (msg := channel.recv()) is not None:
        for lora_id, name, path in msg.adapters:  # (a known id: a look-up; a new one: read from its path)
            if engine.lora is None:
                raise ValueError("enable_lora: rank 0 sent a LoRA adapter but this rank has LoRA disabled")
            engine.lora.add(LoRARequest(name, lora_id, path))
        engine.runner.run(msg.step)
        num_steps += 1
    _stop_heartbeats()
    return num_steps


def run_worker(args: EngineArgs, timeout_s: float | None = None) -> int:
    """A rank > 0 of `jaxserve serve`: no HTTP server, only rank 0's steps; 0 after rank 0's stop."""
    engine = worker_engine(args)
    num_steps = follow(engine, timeout_s)
    log.info("host rank %d: ran %d steps from rank 0, %d compilations after warm-up", jax.process_index(),
             num_steps, engine.get_stats().num_compilations_after_warmup)
    return 0
