"""The adapters an engine knows, their host copies, and which device slot holds which (no JAX).

    LoRAManager    name -> LoRARequest (what `--lora-modules` and /v1/load_lora_adapter serve),
                   lora_int_id -> LoRARequest (every adapter a request has used), and the host
                   copies of at most max_cpu_loras adapters, least recently used evicted (an
                   evicted adapter is read from its path again when a step needs it)
    ReplicatedLoRAManager   the same names over several engines (data-parallel replicas): an
                   adapter is served by every replica, under the same id
    SlotTable      lora_int_id -> device slot 1..max_loras, least recently used reassigned; the
                   runner asks it for a step's adapters and writes the slots it reports

As vLLM: --max-loras bounds the adapters in one step (device slots) and --max-cpu-loras the host
copies; neither bounds how many names are served (an adapter without a host copy is read again).
Ids are never reused (the next is one past the largest ever seen), so a step, the prefix cache or
another rank never mistakes a new adapter for an unloaded one.

Thread safety: HTTP threads load and unload names while the engine thread reads. `_lock` guards
the dictionaries (held briefly: the engine thread takes it every step); `_serve_lock` makes a new
name's or id's check, read and store one step, so two concurrent loads never share an id or a name.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from jaxserve.lora.peft import LoRAWeights, load_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.models import registry
from jaxserve.models.config import ModelConfig


def check_lora_model(cfg: ModelConfig) -> None:
    """Refuse a model LoRA cannot serve, from its config alone (before any weight is read): the
    adapters target the dense projections, and a mixture of experts has none in its feed-forward."""
    if cfg.moe is not None:
        raise ValueError(f"enable_lora: LoRA adapters are supported on dense models; {cfg.architecture} "
                         "is a mixture of experts")
    if registry.is_supported(cfg.architecture) and registry.get_family(cfg.architecture).forward is not None:
        raise ValueError(f"enable_lora: LoRA adapters are not supported for {cfg.architecture} yet "
                         "(it runs its own layer body: models/gemma.py)")


class LoRAManager:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.cfg, self.max_loras, self.max_lora_rank = cfg, max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.by_name: dict[str, LoRARequest] = {}
        self.by_id: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, LoRAWeights] = OrderedDict()
        self._lock = threading.Lock()
        self._serve_lock = threading.RLock()  # (re-entered: load -> register -> add)

    # -- names (serving) ---------------------------------------------------------------------------
    def next_id(self) -> int:
        """The id a new adapter would get now (a hint: `load` takes its own under the lock)."""
        with self._lock:
            return max(self.by_id, default=0) + 1

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the adapter at `path` as `name` under a fresh id (--lora-modules, /v1/load_lora_adapter):
        the name's check, the id, the read and the store under one lock. ValueError naming the field."""
        with self._serve_lock:
            return self.register(LoRARequest(name, self.next_id(), path, base_model_name))

    def register(self, request: LoRARequest, weights: LoRAWeights | None = None) -> LoRARequest:
        """Serve `request` under its name: read and check it now (ValueError naming the field).
        `weights`: its host copy when the caller has already read it (data-parallel replicas share one)."""
        with self._serve_lock:
            if request.lora_name in self.by_name:
                raise ValueError(f"lora_name: the lora adapter '{request.lora_name}' has already been loaded")
            self.add(request, weights)
            with self._lock:
                self.by_name[request.lora_name] = request
        return request

    def unregister(self, name: str) -> LoRARequest | None:
        """Stop serving a name (requests already running keep their adapter)."""
        with self._lock:
            return self.by_name.pop(name, None)

    def resolve(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self.by_name.get(name)

    def served(self) -> list[LoRARequest]:
        with self._lock:
            return list(self.by_name.values())

    # -- ids (requests) --------------------------------------------------------------------------
    def add(self, request: LoRARequest, weights: LoRAWeights | None = None) -> None:
        """Make sure a request's adapter is known and readable; ValueError otherwise. A known id
        costs one dictionary look-up (the engine thread asks for every request it adds)."""
        if self._known(request):
            return
        with self._serve_lock:  # a new id: checked again, read and stored as one
            if self._known(request):
                return
            if weights is None:
                weights = load_adapter(request.lora_path, self.cfg, self.max_lora_rank)
            with self._lock:
                self.by_id[request.lora_int_id] = request
                self._keep(request.lora_int_id, weights)

    def _known(self, request: LoRARequest) -> bool:
        """Whether `request`'s id is registered (ValueError when it names another adapter)."""
        with self._lock:
            known = self.by_id.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(f"lora_int_id: {request.lora_int_id} already names adapter {known.lora_name!r} "
                             f"({known.lora_path}), not {request.lora_name!r} ({request.lora_path})")
        return known is not None

    def weights(self, lora_int_id: int) -> LoRAWeights:
        """An adapter's host copy (read from its path again if it was evicted)."""
        with self._lock:
            w = self._host.get(lora_int_id)
            if w is not None:
                self._host.move_to_end(lora_int_id)
                return w
            request = self.by_id[lora_int_id]
        w = load_adapter(request.lora_path, self.cfg, self.max_lora_rank)
        with self._lock:
            self._keep(lora_int_id, w)
        return w

    def _keep(self, lora_int_id: int, weights: LoRAWeights) -> None:
        self._host[lora_int_id] = weights
        self._host.move_to_end(lora_int_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def request(self, lora_int_id: int) -> LoRARequest:
        """The adapter a known id names (KeyError for an id no request has used)."""
        with self._lock:
            return self.by_id[lora_int_id]

    def name_of(self, lora_int_id: int) -> str:
        with self._lock:
            r = self.by_id.get(lora_int_id)
        return r.lora_name if r is not None else str(lora_int_id)

    @property
    def num_host_copies(self) -> int:
        return len(self._host)


class ReplicatedLoRAManager:
    """The served names of several engines' LoRAManagers (data-parallel replicas): an adapter is
    loaded on every replica under the same id, read once, and unloaded from every one; a name
    resolves to the same LoRARequest whichever replica then takes the request."""

    def __init__(self, managers: list[LoRAManager]) -> None:
        self.managers = managers
        first = managers[0]
        self.cfg, self.max_loras, self.max_lora_rank = first.cfg, first.max_loras, first.max_lora_rank
        self._lock = threading.Lock()  # one load or unload at a time over all replicas

    def next_id(self) -> int:
        return max(m.next_id() for m in self.managers)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve `name` on every replica (ValueError naming the field; then on none)."""
        with self._lock:
            if self.resolve(name) is not None:
                raise ValueError(f"lora_name: the lora adapter '{name}' has already been loaded")
            request = LoRARequest(name, self.next_id(), path, base_model_name)
            weights = load_adapter(path, self.cfg, self.max_lora_rank)
            done: list[LoRAManager] = []
            try:
                for m in self.managers:
                    m.register(request, weights)
                    done.append(m)
            except ValueError:
                for m in done:
                    m.unregister(name)
                raise
        return request

    def unregister(self, name: str) -> LoRARequest | None:
        with self._lock:
            return [m.unregister(name) for m in self.managers][0]

    def resolve(self, name: str) -> LoRARequest | None:
        return self.managers[0].resolve(name)

    def served(self) -> list[LoRARequest]:
        return self.managers[0].served()


class SlotTable:
    """Which adapter each device slot (1..max_loras) holds; slot 0 is the base model."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first

    def assign(self, lora_ids: set[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for a step's adapters (at most max_loras), and the (slot, lora id) writes needed:
        a free slot first, else the least recently used slot of an adapter this step does not use."""
        wanted = {i for i in lora_ids if i}
        if len(wanted) > self.max_loras:
            raise ValueError(f"max_loras: a step has {len(wanted)} adapters but there are {self.max_loras} slots")
        writes = []
        for lora_id in sorted(wanted):
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            used = set(self._slot_of.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self._slot_of if i not in wanted)
                slot = self._slot_of.pop(victim)
            self._slot_of[lora_id] = slot
            writes.append((slot, lora_id))
        return {i: self._slot_of[i] for i in wanted}, writes

    def slot_of(self, lora_id: int) -> int | None:
        return self._slot_of.get(lora_id)
