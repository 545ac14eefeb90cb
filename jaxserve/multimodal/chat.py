"""Image content parts of chat messages (`LLM.chat`), as vLLM takes them:

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   a data URL
    {"type": "image_pil", "image_pil": PIL.Image}  /  {"type": "image", "image": PIL.Image}

Each becomes {"type": "image"} in the conversation the chat template renders (Qwen's template writes
<|vision_start|><|image_pad|><|vision_end|> for it), and its image goes to multi_modal_data in order.
http(s) URLs and file:// paths are not fetched yet: a ValueError naming the part, as is a body
Pillow cannot read (a truncated PNG, a decompression bomb past Pillow's pixel limit).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any


def chat_images(conversation: list[dict]) -> tuple[list[dict], list[Any]]:
    """(the conversation with image parts as {"type": "image"}, their images in order)."""
    out, images = [], []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "image_pil", "image"):
                images.append(_image(part, kind, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            elif kind in ("video_url", "video", "input_audio", "audio_url"):
                raise ValueError(f"messages[{i}].content[{j}]: {kind} parts are not supported yet")
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def _image(part: dict, kind: str, where: str):
    from PIL import Image

    if kind != "image_url":
        image = part.get(kind)
        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}.{kind}: expected a PIL.Image, got {type(image).__name__}")
        return image
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise ValueError(f"{where}.image_url.url: expected a string URL")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ValueError(f"{where}.image_url.url: only data: URLs are read for now, not {scheme!r}")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError(f"{where}.image_url.url: a data URL must be base64 (data:image/...;base64,...)")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()  # decodes now: a truncated or corrupt body fails here, not in the processor
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}.image_url.url: not valid base64 ({e})") from None
    except Exception as e:  # noqa: BLE001  (Pillow: UnidentifiedImageError, OSError, DecompressionBombError)
        raise ValueError(f"{where}.image_url.url: not a readable image ({type(e).__name__}: {e})") from None
    return image
