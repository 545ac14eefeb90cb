"""Image content parts of chat messages (`LLM.chat`, /v1/chat/completions), as vLLM takes them:

    {"type": "image_url", "image_url": {"url": ...}}   a data:, http(s) or (under --allowed-local-media-path)
                                                        file:// URL, read by media.MediaLoader
    {"type": "image_pil", "image_pil": PIL.Image}  /  {"type": "image", "image": PIL.Image}   (LLM.chat)

Each becomes {"type": "image"} in the conversation the chat template renders (Qwen's template writes
<|vision_start|><|image_pad|><|vision_end|> for it), and its image goes to multi_modal_data in order.
The count limit (--limit-mm-per-prompt) is checked before any URL is read. Every failure is a ValueError
naming the part.
"""

from __future__ import annotations

from typing import Any

from jaxserve.multimodal.media import MediaLoader

IMAGE_KINDS = ("image_url", "image_pil", "image")


def chat_images(conversation: list[dict], media: MediaLoader | None = None,
                limit: int | None = None) -> tuple[list[dict], list[Any]]:
    """(the conversation with image parts as {"type": "image"}, their images in order); `media` None: a
    loader without local files, `limit` None: any number of images."""
    found = [(i, j) for i, message in enumerate(conversation) if isinstance(message, dict)
             and isinstance(message.get("content"), list) for j, part in enumerate(message["content"])
             if isinstance(part, dict) and part.get("type") in IMAGE_KINDS]
    if limit is not None and len(found) > limit:  # before any URL is fetched or decoded
        i, j = found[limit]
        raise ValueError(f"messages[{i}].content[{j}]: {len(found)} images in the prompt, more than "
                         f"--limit-mm-per-prompt's {limit}")
    media = media or MediaLoader()
    for i, j in found:  # every URL's host judged before any image is fetched (no work spent on a refused request)
        spec = conversation[i]["content"][j].get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if isinstance(url, str):
            media.precheck(url, f"messages[{i}].content[{j}].image_url.url")
    out, images = [], []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_KINDS:
                images.append(_image(part, kind, f"messages[{i}].content[{j}]", media))
                parts.append({"type": "image"})
            elif kind in ("video_url", "video", "input_audio", "audio_url"):
                raise ValueError(f"messages[{i}].content[{j}]: {kind} parts are not supported yet")
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def has_media(conversation: list[dict]) -> bool:
    """Whether a message has a part other than text (an image to read, or a video part to refuse)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and
               any(not isinstance(p, dict) or p.get("type") != "text" for p in m["content"]) for m in conversation)


def _image(part: dict, kind: str, where: str, media: MediaLoader):
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
    return media.load(url, f"{where}.image_url.url")
