"""Prompts with images in, as vLLM takes them: `{"prompt": ..., "multi_modal_data": {"image": img | [imgs]}}`
(Pillow images, or arrays Pillow reads), the prompt holding one image placeholder per image
(Qwen: <|vision_start|><|image_pad|><|vision_end|>), or the placeholders already expanded.

The pixels are the checkpoint's own image processor's (transformers' AutoImageProcessor:
Qwen2VLImageProcessor's smart_resize, min/max pixels and normalisation from preprocessor_config.json):
never a resize of ours. Each placeholder becomes as many tokens as the tower gives the image rows
(its patch grid / merge_size**2), and the request carries the patches, the spans and M-RoPE's
positions (inputs.MultiModalInputs). Bad input is a ValueError naming the field, before any step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.models.vision.config import VisionConfig
from jaxserve.multimodal.inputs import ImageItem, MultiModalInputs, image_hash, rope_index
from jaxserve.multimodal.media import MediaLoader, image_limit
from jaxserve.multimodal.options import Entry, ProcessorCache, check_processor_kwargs, refuse_unless_images

class TextOnly:
    """A model without a vision tower: prompts with images are refused."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture
        self.media, self.limit = MediaLoader(), None

    def apply(self, prompt: Any, token_ids: list[int]) -> tuple[list[int], MultiModalInputs | None]:
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError(f"multi_modal_data: {self.architecture} takes text only")
        return token_ids, None


class ImageProcessor:
    """A vision-language model's prompts: images through the checkpoint's processor, placeholders expanded."""

    def __init__(self, vision: VisionConfig, model_dir: Path, media: MediaLoader | None = None,
                 limit: int | None = None, kwargs: dict | None = None, cache_gb: float = 0.0) -> None:
        from transformers import AutoImageProcessor

        self.vision, self.media, self.limit = vision, media or MediaLoader(), limit  # limit: images a prompt
        self.max_patches: int | None = None  # the tower's budget (bind): a larger image is refused
        self.cache = ProcessorCache.from_gb(cache_gb)  # --mm-processor-cache-gb (None: 0, no cache)
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            raise ValueError(f"model: {model_dir} has no image processor config (preprocessor_config.json) for "
                             f"its images: {e}") from None
        if kwargs:  # --mm-processor-kwargs: checked against the class, laid over the config, tried once
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir),
                                                                **check_processor_kwargs(kwargs, self.processor))
            try:
                self.processor(images=[_probe_image()], return_tensors="np")
            except Exception as e:  # noqa: BLE001  (a value the processor cannot use: TypeError, ValueError, ...)
                raise ValueError(f"mm_processor_kwargs: the image processor fails with {kwargs}: "
                                 f"{type(e).__name__}: {e}") from None

    def apply(self, prompt: Any, token_ids: list[int]) -> tuple[list[int], MultiModalInputs | None]:
        """(the prompt's token ids with each image's placeholders expanded, its images) for a prompt
        already tokenized as `token_ids`; ValueError naming the field for anything wrong."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict) and isinstance(prompt.get("mm_inputs"), MultiModalInputs):
            return token_ids, prompt["mm_inputs"]  # processed already (AsyncLLM, off the engine thread)
        images = self._images(data)
        if self.limit is not None and len(images) > self.limit:
            raise ValueError(f"multi_modal_data.image: {len(images)} images, more than --limit-mm-per-prompt's "
                             f"{self.limit}")
        placeholder = self.vision.image_token_id
        if not images:
            if placeholder in token_ids:
                raise ValueError(f"prompt: holds image placeholder tokens (id {placeholder}) but "
                                 "multi_modal_data has no image")
            return token_ids, None
        processed = self._process(images)
        grids = [g for _, g, _ in processed]
        for i, (t, h, w) in enumerate(grids):
            if self.max_patches is not None and t * h * w > self.max_patches:
                raise ValueError(f"multi_modal_data.image[{i}]: {t * h * w} patches, more than the encoder budget "
                                 f"of {self.max_patches}")
        counts = [t * h * w // self.vision.merge_unit for t, h, w in grids]
        ids, offsets = _expand(token_ids, placeholder, counts)
        items = tuple(ImageItem(digest, off, n, pixels, g)
                      for (pixels, g, digest), off, n in zip(processed, offsets, counts))
        positions, delta = rope_index(len(ids), [(im.offset, im.length, im.grid) for im in items],
                                      self.vision.spatial_merge_size)
        return ids, MultiModalInputs(items, positions, delta)

    def _process(self, images: list) -> list[Entry]:
        """Each image's (patches, (t, h, w) grid, hash): from the processor cache, the misses through the
        checkpoint's processor in one call."""
        keys = [self.cache.key(im) for im in images] if self.cache is not None else [None] * len(images)
        found = [self.cache.get(k) if self.cache is not None else None for k in keys]
        missing = [i for i, entry in enumerate(found) if entry is None]
        if not missing:
            return found  # type: ignore[return-value]  # every one cached
        try:
            out = self.processor(images=[images[i] for i in missing], return_tensors="np")
        except ValueError as e:  # Qwen's smart_resize: an aspect ratio over 200, ...
            raise ValueError(f"multi_modal_data.image: the model's image processor refused an image: {e}") from None
        grids = [tuple(int(x) for x in g) for g in np.asarray(out["image_grid_thw"])]
        pixels = np.asarray(out["pixel_values"])
        starts = np.cumsum([0] + [t * h * w for t, h, w in grids])
        for i, a, b, grid in zip(missing, starts[:-1], starts[1:], grids):
            found[i] = (pixels[a:b], grid, image_hash(pixels[a:b], grid))
            if self.cache is not None:
                self.cache.put(keys[i], found[i])
        return found  # type: ignore[return-value]  # each filled above

    def max_image_patches(self) -> int | None:
        """The patches of the largest image the processor makes (its max_pixels; None: unbounded)."""
        size = getattr(self.processor, "size", None)
        pixels = getattr(self.processor, "max_pixels", None) or (
            size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None))
        return None if pixels is None else int(pixels) // self.vision.patch_size ** 2

    def bind(self, runner: Any) -> None:
        """vLLM's encoder budget: the runner's (max_num_batched_tokens rows) raised to the largest image the
        processor makes, images being resized down to max_pixels; so no image is refused for its size
        unless the processor's config sets no max_pixels."""
        largest = self.max_image_patches()
        runner.patch_budget = max(runner.patch_budget, largest or 0)
        self.max_patches = runner.patch_budget

    @staticmethod
    def _images(data: Any) -> list:
        from PIL import Image

        if data is None:
            return []
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data: expected a dict such as {{'image': ...}}, got {type(data).__name__}")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            what = "video is not supported yet" if "video" in unknown else "only 'image' is supported"
            raise ValueError(f"multi_modal_data: {unknown[0]!r}: {what}")
        images = data.get("image")
        images = images if isinstance(images, (list, tuple)) else [images]
        out = []
        for i, im in enumerate(images):
            if isinstance(im, np.ndarray):
                im = Image.fromarray(im)
            if not isinstance(im, Image.Image):
                raise ValueError(f"multi_modal_data.image[{i}]: expected a PIL.Image (or an array of pixels), got "
                                 f"{type(im).__name__}")
            out.append(im.convert("RGB"))
        return out


def _probe_image() -> Any:
    """A small image to try the processor's options on at start-up."""
    from PIL import Image

    return Image.new("RGB", (56, 56), (128, 64, 32))


def _expand(token_ids: list[int], placeholder: int, counts: list[int]) -> tuple[list[int], list[int]]:
    """The ids with the i-th image's placeholder run made counts[i] long, and each run's offset. A run is
    taken as one placeholder (vLLM's prompt form) or as already expanded when its length is counts[i]."""
    runs, i = [], 0
    while i < len(token_ids):
        if token_ids[i] == placeholder:
            j = i
            while j < len(token_ids) and token_ids[j] == placeholder:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if len(runs) != len(counts) or any(n not in (1, c) for (_, n), c in zip(runs, counts)):
        found = sum(n for _, n in runs)
        raise ValueError(f"prompt: {found} image placeholder token(s) in {len(runs)} run(s) for {len(counts)} "
                         f"image(s) in multi_modal_data.image: write one placeholder per image (Qwen: "
                         f"<|vision_start|><|image_pad|><|vision_end|>), or each image's {counts} expanded")
    ids, offsets, prev = [], [], 0
    for (start, n), count in zip(runs, counts):
        ids += token_ids[prev:start]
        offsets.append(len(ids))
        ids += [placeholder] * count
        prev = start + n
    return ids + token_ids[prev:], offsets


def processor_for(model: Any, args: Any) -> TextOnly | ImageProcessor:
    """The engine's prompt processor for a LoadedModel: images only for a model with a vision tower (its
    unsupported engine flags were refused before its weights were read: models/qwen2_vl.refuse_flags)."""
    refuse_unless_images(model.config, args)  # (a model the engine loads: checked before its weights were read)
    vision = model.config.vision
    if vision is None:
        return TextOnly(model.config.architecture)
    media, limit = MediaLoader.from_args(args), image_limit(args)  # the flags checked at start-up
    if model.tokenizer is None:
        raise ValueError(f"model: {model.config.architecture} needs its tokenizer beside the weights")
    return ImageProcessor(vision, model.path, media, limit, getattr(args, "mm_processor_kwargs", None),
                          getattr(args, "mm_processor_cache_gb", 0.0))


def image_processor_of(engine: Any) -> ImageProcessor | None:
    """The server's engine client's image processor (AsyncLLM's engine's); None: a text-only model."""
    processor = getattr(getattr(engine, "engine", None), "mm_processor", None)
    return processor if isinstance(processor, ImageProcessor) else None
