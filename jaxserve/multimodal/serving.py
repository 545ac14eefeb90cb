"""/v1/chat/completions with images (vLLM's `image_url` content parts), for serving_chat:

    chat_images_async   a vision-language model's request: its conversation with the image parts read
                        (fetched, decoded: media.MediaLoader) in a worker thread, off the event loop;
                        (None, []) for a text-only model (serving_chat then refuses any non-text part
                        with a 400 naming messages.N.content) or a request without images
    with_images         the rendered prompt's placeholders expanded and its images processed by the
                        checkpoint's processor, in a worker thread: the engine gets
                        {"prompt_token_ids", "mm_inputs"} and the prompt's length counts every image token

Every failure is a ValueError naming the part (a 400); the server goes on serving.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from jaxserve.multimodal.chat import chat_images, has_media
from jaxserve.multimodal.processor import image_processor_of


async def chat_images_async(engine: Any, req: Any,
                            conversation: Callable[..., list[dict]]) -> tuple[list[dict] | None, list[Any]]:
    """`conversation`: serving_chat's, passed down (a front end's function: this layer does not import it)."""
    processor = image_processor_of(engine)
    if processor is None:
        return None, []
    conv = conversation(req.messages, keep_parts=True)
    if not has_media(conv):  # text parts only: nothing to read
        return conv, []
    return await asyncio.to_thread(chat_images, conv, processor.media, processor.limit)


async def with_images(engine: Any, prompt_ids: list[int], images: list[Any],
                      truncate_prompt_tokens: int | None) -> tuple[list[int] | dict, list[int]]:
    """(what the engine gets, the prompt's token ids with each image's placeholders expanded)."""
    if not images:
        return prompt_ids, prompt_ids
    if truncate_prompt_tokens is not None:  # cutting the prompt could cut an image's span
        raise ValueError("truncate_prompt_tokens: not supported with images")
    processor = image_processor_of(engine)
    assert processor is not None  # images are only read for a vision-language model
    prompt = {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": images}}
    ids, mm = await asyncio.to_thread(processor.apply, prompt, prompt_ids)
    return {"prompt_token_ids": ids, "mm_inputs": mm}, ids
