"""vLLM's multimodal engine flags beyond the URL rules (media.py, fetch.py), checked at start-up:

    --mm-processor-kwargs      JSON laid over the checkpoint's image processor config (Qwen: {"min_pixels":
                               ..., "max_pixels": ...}); a key the processor class does not take is a
                               ValueError naming it (vLLM drops such keys with a warning: a typo would then
                               silently change nothing)
    --mm-processor-cache-gb    vLLM's processor cache: an image's processed patches kept (LRU, this many GiB)
                               by the hash of its decoded pixels, so the same image sent again (a screenshot
                               in every turn of a chat) is not resized and normalised again; 0 disables it
    a text-only model          any of these flags given is refused by name (refuse_for_text_only): a flag that
                               does nothing is an error, never ignored
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

# the multimodal EngineArgs fields and their defaults: one given otherwise, for a model without images, is refused
MM_FLAG_DEFAULTS: dict[str, Any] = {"limit_mm_per_prompt": None, "allowed_local_media_path": None,
                                    "allowed_media_domains": None, "mm_processor_kwargs": None,
                                    "mm_processor_cache_gb": 4.0}
# the processor's call options jaxserve sets itself (numpy arrays on the host)
_OURS = ("return_tensors", "device", "data_format", "input_data_format")


def refuse_for_text_only(args: Any, architecture: str) -> None:
    """ValueError naming the first multimodal flag given to a model that takes no images; before its weights."""
    for name, default in MM_FLAG_DEFAULTS.items():
        if getattr(args, name, default) != default:
            raise ValueError(f"{name}: does not apply to {architecture}, a model without images: remove "
                             f"--{name.replace('_', '-')}")


def refuse_unless_images(cfg: Any, args: Any) -> None:
    """The engine's start-up check for a ModelConfig, before any weight is read."""
    if getattr(cfg, "vision", None) is None:
        refuse_for_text_only(args, cfg.architecture)


def processor_keys(processor: Any) -> set[str] | None:
    """The keyword arguments the image processor's class takes (None: it does not say)."""
    typed = getattr(type(processor), "valid_kwargs", None)  # transformers >= 4.57: a TypedDict of them
    if typed is not None and hasattr(typed, "__annotations__"):
        return set(getattr(typed, "__required_keys__", set())) | set(getattr(typed, "__optional_keys__", set())) \
            | set(typed.__annotations__)
    legacy = getattr(processor, "_valid_processor_keys", None)  # older transformers
    return set(legacy) if legacy else None


def check_processor_kwargs(kwargs: Any, processor: Any) -> dict:
    """--mm-processor-kwargs checked against the processor class: ValueError naming an unknown key."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"mm_processor_kwargs: expected a JSON object such as {{\"max_pixels\": 1003520}}, "
                         f"got {kwargs!r}")
    known = processor_keys(processor)
    for key in kwargs:
        if key in _OURS:
            raise ValueError(f"mm_processor_kwargs: {key!r} is set by jaxserve, not by the flag")
        if known is not None and key not in known:
            raise ValueError(f"mm_processor_kwargs: {key!r} is not an option of {type(processor).__name__} "
                             f"(it takes: {', '.join(sorted(k for k in known if k not in _OURS))})")
    return dict(kwargs)


Entry = tuple[np.ndarray, tuple[int, int, int], str]  # (patches, (t, h, w) grid, the patches' hash)


class ProcessorCache:
    """Processed images by the hash of their decoded pixels, least recently used evicted past
    `capacity_bytes`. Thread-safe: requests are processed in worker threads at once."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes, self.num_bytes = capacity_bytes, 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_gb(cls, gb: float) -> "ProcessorCache | None":
        """vLLM's --mm-processor-cache-gb: None (no cache) for 0."""
        return cls(int(gb * (1 << 30))) if gb > 0 else None

    @staticmethod
    def key(image: Any) -> str:
        """The decoded image's identity: its mode, size and pixels (the processor sees nothing else)."""
        h = hashlib.sha256(f"{image.mode}|{image.size}".encode())
        h.update(image.tobytes())
        return h.hexdigest()

    def get(self, key: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: str, entry: Entry) -> None:
        size = entry[0].nbytes
        if size > self.capacity_bytes:
            return
        entry[0].flags.writeable = False  # shared by every request that sends this image
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = entry
            self.num_bytes += size
            while self.num_bytes > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self.num_bytes -= old[0].nbytes
