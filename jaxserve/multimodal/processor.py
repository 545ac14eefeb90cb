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

class TextOnly:
    """A model without a vision tower: prompts with images are refused."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture

    def apply(self, prompt: Any, token_ids: list[int]) -> tuple[list[int], MultiModalInputs | None]:
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError(f"multi_modal_data: {self.architecture} takes text only")
        return token_ids, None


class ImageProcessor:
    """A vision-language model's prompts: images through the checkpoint's processor, placeholders expanded."""

    def __init__(self, vision: VisionConfig, model_dir: Path) -> None:
        from transformers import AutoImageProcessor

        self.vision = vision
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            raise ValueError(f"model: {model_dir} has no image processor config (preprocessor_config.json) for "
                             f"its images: {e}") from None

    def apply(self, prompt: Any, token_ids: list[int]) -> tuple[list[int], MultiModalInputs | None]:
        """(the prompt's token ids with each image's placeholders expanded, its images) for a prompt
        already tokenized as `token_ids`; ValueError naming the field for anything wrong."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict) and isinstance(prompt.get("mm_inputs"), MultiModalInputs):
            return token_ids, prompt["mm_inputs"]  # processed already (AsyncLLM, off the engine thread)
        images = self._images(data)
        placeholder = self.vision.image_token_id
        if not images:
            if placeholder in token_ids:
                raise ValueError(f"prompt: holds image placeholder tokens (id {placeholder}) but "
                                 "multi_modal_data has no image")
            return token_ids, None
        out = self.processor(images=images, return_tensors="np")
        grids = [tuple(int(x) for x in g) for g in np.asarray(out["image_grid_thw"])]
        pixels = np.asarray(out["pixel_values"])
        counts = [t * h * w // self.vision.merge_unit for t, h, w in grids]
        ids, offsets = _expand(token_ids, placeholder, counts)
        starts = np.cumsum([0] + [t * h * w for t, h, w in grids])
        items = tuple(ImageItem(image_hash(pixels[a:b], g), off, n, pixels[a:b], g)
                      for a, b, g, off, n in zip(starts[:-1], starts[1:], grids, offsets, counts))
        positions, delta = rope_index(len(ids), [(im.offset, im.length, im.grid) for im in items],
                                      self.vision.spatial_merge_size)
        return ids, MultiModalInputs(items, positions, delta)

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
    vision = model.config.vision
    if vision is None:
        return TextOnly(model.config.architecture)
    if model.tokenizer is None:
        raise ValueError(f"model: {model.config.architecture} needs its tokenizer beside the weights")
    return ImageProcessor(vision, model.path)
