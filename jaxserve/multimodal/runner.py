"""The runner's side of a vision-language model (ModelRunner.mm): each step's M-RoPE positions, and the
image rows that replace the placeholder tokens' embeddings.

    prepare(out, batch)   host: positions [3, T] from each request's MultiModalInputs (text-only requests
                          and padding on the diagonal), and which rows of which image this step's tokens
                          hold (a chunk of a prompt may hold part of an image: the rows are sliced)
    attach(batch, step)   device side, in dispatch: the tower runs on the step's images not in the
                          encoder cache (one ragged batch of their patches, bucketed), and the step's
                          rows go to the model as mm_embeds [T, hidden] with mm_mask [T] (every step of
                          the model has them, zeros kept on the device where it has no image: one
                          program per token bucket)

The encoder cache holds each image's rows on the host, keyed by the image's content hash: the same
image in several requests, or in several chunks of one, runs the tower once while it stays cached
(least recently used entries beyond `cache_bytes` are dropped; a dropped one is encoded again).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.models.vision.config import VisionConfig
from jaxserve.models.vision.qwen2_vl_vision import patch_layout, vision_forward
from jaxserve.multimodal.inputs import ImageItem
from jaxserve.parallel.jit import fresh_jit
from jaxserve.worker.input_batch import StepInput

MIN_PATCH_BUCKET = 64  # the vision program's smallest patch count (powers of two up from it)
DEFAULT_CACHE_BYTES = 512 << 20


@dataclass(frozen=True)
class MultiModalStep:
    """A step's image rows, as host data: (image, first row of its output, rows, the step's token row)."""
    slices: list[tuple[ImageItem, int, int, int]]


class MultiModalRunner:
    def __init__(self, vision: VisionConfig, dtype: jnp.dtype, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.vision, self.dtype, self.cache_bytes = vision, dtype, cache_bytes
        self._encode = fresh_jit(vision_forward, static_argnums=1)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cached_bytes = 0
        self.num_images_encoded = 0  # tower runs per image: the encoder cache's test counter
        self._no_rows: dict[int, tuple[jax.Array, jax.Array]] = {}  # token bucket -> zero rows, no mask

    # ---- host ----------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, batch: StepInput) -> tuple[StepInput, MultiModalStep | None]:
        """`batch` with M-RoPE positions [3, T], and the step's image rows (None: the step has none)."""
        num_tokens = batch.token_ids.shape[0]
        positions = np.broadcast_to(np.asarray(batch.positions, np.int32), (3, num_tokens)).copy()
        slices, row = [], 0
        for sr in out.scheduled:
            n, mm = len(sr.token_ids), sr.mm_inputs
            if mm is not None:
                positions[:, row:row + n] = mm.positions_for(sr.start_pos, n)
                for im in mm.images:  # the overlap of [offset, offset + length) with this step's tokens
                    lo, hi = max(im.offset, sr.start_pos), min(im.offset + im.length, sr.start_pos + n)
                    if lo < hi:
                        slices.append((im, lo - im.offset, hi - lo, row + lo - sr.start_pos))
            row += n
        batch = dataclasses.replace(batch, positions=positions)
        return batch, (MultiModalStep(slices) if slices else None)

    def text_batch(self, batch: StepInput) -> StepInput:
        """A batch of text (warm-up's empty ones) as this model's steps are: positions on M-RoPE's
        diagonal [3, T], no image rows."""
        positions = np.asarray(batch.positions, np.int32)
        batch = dataclasses.replace(batch, positions=np.broadcast_to(positions, (3, positions.shape[0])).copy())
        return self.attach(batch, None, {})

    # ---- device --------------------------------------------------------------------------------
    def attach(self, batch: StepInput, step: MultiModalStep | None, params: dict) -> StepInput:
        """`batch` with the step's image rows (the tower run on the images not cached); a step without
        images gets zeros kept on the device, so both run the one program of their token bucket."""
        num_tokens = batch.token_ids.shape[0]
        if step is None:
            if num_tokens not in self._no_rows:
                self._no_rows[num_tokens] = (jnp.zeros((num_tokens, self.vision.out_hidden_size), self.dtype),
                                             jnp.zeros(num_tokens, bool))
            embeds, mask = self._no_rows[num_tokens]
            return dataclasses.replace(batch, mm_embeds=embeds, mm_mask=mask)
        rows = self._rows([im for im, *_ in step.slices], params["vision"])
        embeds = np.zeros((num_tokens, self.vision.out_hidden_size), np.float32)
        mask = np.zeros(num_tokens, bool)
        for im, first, num, row in step.slices:
            embeds[row:row + num] = rows[im.hash][first:first + num]
            mask[row:row + num] = True
        return dataclasses.replace(batch, mm_embeds=jnp.asarray(embeds, self.dtype), mm_mask=jnp.asarray(mask))

    def _rows(self, images: list[ImageItem], params: dict) -> dict[str, np.ndarray]:
        """Each image's merged rows [length, out_hidden]: from the cache, or from one tower run over
        the images it lacks (then cached)."""
        found = {}
        for im in images:
            if im.hash in self._cache:
                found[im.hash] = self._cache[im.hash]
                self._cache.move_to_end(im.hash)
        todo = list({im.hash: im for im in images if im.hash not in found}.values())
        if not todo:
            return found
        vc = self.vision
        num = sum(im.pixel_values.shape[0] for im in todo)
        size = max(MIN_PATCH_BUCKET, 1 << (num - 1).bit_length())  # one program per power of two
        pos, seg_full, seg_window = patch_layout(vc, [im.grid for im in todo], size)
        pixels = np.zeros((size, vc.patch_dim), np.float32)
        pixels[:num] = np.concatenate([im.pixel_values for im in todo])
        merged = np.asarray(jax.device_get(self._encode(params, vc, jnp.asarray(pixels, self.dtype), pos, seg_full,
                                                        seg_window)))
        start = 0
        for im in todo:
            found[im.hash] = merged[start:start + im.length]
            self._store(im.hash, found[im.hash])
            start += im.length
        self.num_images_encoded += len(todo)
        return found

    def _store(self, key: str, rows: np.ndarray) -> None:
        self._cache[key] = rows
        self._cached_bytes += rows.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
