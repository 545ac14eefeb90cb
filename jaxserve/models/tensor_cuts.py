"""Where a layer leaf's row comes from in the checkpoint, for the readers that are not a plain
(name, transpose?) pair: a family's reader (phi3's fused rows, the MoE experts, gpt-oss's fused
expert tensors, DeepSeek's kv_b_proj halves) carries `hf_cuts`, the inverse of what it reads, so the
weights API (weights/hf_names.py) can name each row by the checkpoint's own tensors and write a
row back from them. A reader without it that reads tensors has no per-name form (the API refuses
that family, naming it); one that reads only the config (a flag: gpt-oss's `sliding`, a mixed MoE's
`sparse`) is no weight.

    Cut(name, shape, expert, view, axis, start, stop, step, transpose)
        the row (or its expert `expert`) = swap_last_two?(reshape(hf, view)[..., start:stop:step on axis])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Cut:
    """One piece of a layer leaf's row, cut from the HF tensor `name` (its shape `shape`)."""
    name: str
    shape: tuple[int, ...]
    expert: int | None = None  # the expert of the row this fills (the row's axis 0); None: the whole row
    view: tuple[int, ...] | None = None  # the HF tensor reshaped to this before the slice (kv_b_proj's heads)
    axis: int = 0  # the axis of the (viewed) tensor the slice runs along
    start: int = 0
    stop: int | None = None  # None: to the end
    step: int = 1
    transpose: bool = False  # swap the last two axes (HF's [out, in] -> the engine's [in, out], or back)

    @property
    def whole(self) -> bool:
        """Whether the cut is the whole tensor (no reshape, no slice)."""
        return self.view is None and self.start == 0 and self.stop in (None, self.shape[self.axis]) and self.step == 1


# (the layer's prefix "model.layers.{i}.") -> the cuts that make the leaf's row, in the row's order
Cuts = Callable[[str], "tuple[Cut, ...]"]


def with_cuts(read: Callable, cuts: Cuts) -> Callable:
    """Mark `read` (a layer_tensors reader) with the HF tensors it reads, as Cuts."""
    read.hf_cuts = cuts
    return read
