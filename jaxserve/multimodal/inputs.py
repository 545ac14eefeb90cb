"""A request's images once processed: what the scheduler carries (Request.mm_inputs, ScheduledRequest.mm_inputs)
and the runner reads. Plain numpy, no JAX: the core stays testable without it.

    prompt    t t t <vision_start> i i i i i i <vision_end> t t     (i: the image placeholder, expanded)
    images    ImageItem(offset=4, length=6, the image's patches, its (t, h, w) patch grid, its hash)
    positions M-RoPE's [3, prompt_len] (time, height, width), transformers' get_rope_index:
              text on the diagonal, an image's rows on its merged grid from the position after the
              text before it, the text after it from that grid's largest position + 1
    delta     a token past the prompt (an output, a draft) at index i has position i + delta on all
              three axes (transformers' rope_deltas)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageItem:
    hash: str  # sha256 of its processed patches and grid: the encoder cache's key, and the prefix cache's
    offset: int  # the prompt index of its first placeholder token
    length: int  # its placeholder tokens: the tower's merged rows for it
    pixel_values: np.ndarray  # [patches, channels * temporal * patch * patch], as the processor gives them
    grid: tuple[int, int, int]  # (t, h, w) in patches


@dataclass(frozen=True, eq=False)
class MultiModalInputs:
    images: tuple[ImageItem, ...]
    positions: np.ndarray  # [3, prompt_len] i32
    delta: int

    @property
    def cache_key(self) -> int:
        """A 63-bit key of the request's images, in order: the prefix cache keys the request's blocks by
        it, so the same text with other images shares no KV."""
        digest = hashlib.sha256("|".join(im.hash for im in self.images).encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1 or 1

    def positions_for(self, start: int, num: int) -> np.ndarray:
        """[3, num] positions of the tokens at indices start .. start + num - 1 (prompt or past it)."""
        prompt_len = self.positions.shape[1]
        out = np.empty((3, num), np.int32)
        stop = min(start + num, prompt_len)
        if start < stop:
            out[:, :stop - start] = self.positions[:, start:stop]
        first_past = max(start, prompt_len)
        out[:, first_past - start:] = np.arange(first_past, start + num, dtype=np.int32) + self.delta
        return out


def image_hash(pixel_values: np.ndarray, grid: tuple[int, int, int]) -> str:
    h = hashlib.sha256(np.ascontiguousarray(pixel_values).tobytes())
    h.update(repr((pixel_values.shape, str(pixel_values.dtype), tuple(grid))).encode())
    return h.hexdigest()


def rope_index(prompt_len: int, spans: list[tuple[int, int, tuple[int, int, int]]],
               spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """M-RoPE positions [3, prompt_len] and the delta, for images at (offset, length, (t, h, w) grid)
    spans in prompt order (transformers' Qwen2VLModel.get_rope_index, images only: time steps of 1)."""
    parts, cur, index = [], 0, 0
    for offset, length, (t, h, w) in spans:
        if offset > index:
            parts.append(np.broadcast_to(np.arange(cur, cur + offset - index), (3, offset - index)))
            cur += offset - index
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        grid = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + cur
        if grid.shape[1] != length:
            raise ValueError(f"an image of {t}x{h}x{w} patches takes {grid.shape[1]} placeholder tokens, not {length}")
        parts.append(grid)
        cur += max(gh, gw)
        index = offset + length
    if index < prompt_len:
        parts.append(np.broadcast_to(np.arange(cur, cur + prompt_len - index), (3, prompt_len - index)))
    positions = np.concatenate(parts, axis=1).astype(np.int32)
    return positions, int(positions.max()) + 1 - prompt_len
