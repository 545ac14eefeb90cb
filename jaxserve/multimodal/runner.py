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

The tower's programs: one per power-of-two patch count from MIN_PATCH_BUCKET up to the encoder budget
(vLLM's: max_num_batched_tokens merged rows a step, raised to the largest image the processor makes, so any
image fits), all run at warm-up; a step's new images run in groups within the budget, so any mix of sizes
compiles nothing after warm-up.

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
    def __init__(self, vision: VisionConfig, dtype: jnp.dtype, max_num_batched_tokens: int,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.vision, self.dtype, self.cache_bytes = vision, dtype, cache_bytes
        self.patch_budget = max_num_batched_tokens * vision.merge_unit  # patches a tower run takes at most
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
        # cast on the host and device_put: a device-side cast, or jnp.asarray (jax 0.10 compiles a `stage`
        # program per shape for it), would be one more program per token bucket after warm-up
        return dataclasses.replace(batch, mm_embeds=jax.device_put(embeds.astype(self.dtype)),
                                   mm_mask=jax.device_put(mask))

    def _rows(self, images: list[ImageItem], params: dict) -> dict[str, np.ndarray]:
        """Each image's merged rows [length, out_hidden]: from the cache, or from one tower run over
        the images it lacks (then cached)."""
        found = {}
        for im in images:
            if im.hash in self._cache:
                found[im.hash] = self._cache[im.hash]
                self._cache.move_to_end(im.hash)
        todo = list({im.hash: im for im in images if im.hash not in found}.values())
        for group in self._groups(todo):
            merged = self._run(params, [im.grid for im in group], [im.pixel_values for im in group])
            start = 0
            for im in group:
                found[im.hash] = merged[start:start + im.length]
                self._store(im.hash, found[im.hash])
                start += im.length
            self.num_images_encoded += len(group)
        return found

    @property
    def buckets(self) -> list[int]:
        """The tower's patch counts: powers of two from MIN_PATCH_BUCKET to the first >= the budget."""
        out = [MIN_PATCH_BUCKET]
        while out[-1] < self.patch_budget:
            out.append(out[-1] * 2)
        return out

    def _groups(self, todo: list[ImageItem]) -> list[list[ImageItem]]:
        """The images in runs of at most the largest bucket's patches (each image fits one: the
        processor refuses a larger one), so no run needs a program warm-up did not compile."""
        groups, size, cap = [], 0, self.buckets[-1]
        for im in todo:
            n = im.pixel_values.shape[0]
            if not groups or size + n > cap:
                groups.append([])
                size = 0
            groups[-1].append(im)
            size += n
        return groups

    def _run(self, params: dict, grids: list[tuple[int, int, int]], pixel_values: list[np.ndarray]) -> np.ndarray:
        """One tower run over the images' patches, padded to their power-of-two bucket: merged rows."""
        vc = self.vision
        num = sum(p.shape[0] for p in pixel_values)
        size = max(MIN_PATCH_BUCKET, 1 << (num - 1).bit_length())  # one program per power of two
        layout = patch_layout(vc, grids, size)  # order, pos_hw, seg_full, seg_window
        pixels = np.zeros((size, vc.patch_dim), np.float32)
        pixels[:num] = np.concatenate(pixel_values)
        return np.asarray(jax.device_get(self._encode(params, vc, jax.device_put(pixels.astype(self.dtype)),
                                                      *layout)))

    def warmup(self, params: dict) -> int:
        """Run the tower once per patch bucket, as serving runs it (a small image padded to the bucket):
        afterwards any images within the budget compile nothing. Returns the number of buckets."""
        m = self.vision.spatial_merge_size
        for size in self.buckets:
            grids = [(1, m, m * (size // (m * m)))]  # one image of exactly `size` patches
            self._run(params, grids, [np.zeros((size, self.vision.patch_dim), np.float32)])
        return len(self.buckets)

    def clear_cache(self) -> None:
        """Forget every image's rows (new weights: engine/weight_sync.py); each is encoded again."""
        self._cache.clear()
        self._cached_bytes = 0

    def _store(self, key: str, rows: np.ndarray) -> None:
        self._cache[key] = rows
        self._cached_bytes += rows.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
