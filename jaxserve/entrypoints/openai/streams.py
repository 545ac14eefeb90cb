"""Async plumbing between engine output streams and HTTP: prime, merge, watch for disconnects.

Why prime: the engine raises ValueError for bad input before its first yield;
awaiting that first output before the response starts lets a streaming request
still fail with a proper 400 instead of an error inside a 200 event stream.

Why merge: a completion with several prompts is several engine requests whose
outputs interleave; `merge_streams` tags each output with its prompt index.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request

T = TypeVar("T")


async def close_all(streams: list[AsyncGenerator[T, None]]) -> None:
    """Close every stream (each one's `finally` aborts its request), even while being cancelled."""
    with anyio.CancelScope(shield=True):
        for stream in streams:
            await stream.aclose()


async def prime(streams: list[AsyncGenerator[T, None]]) -> list[T]:
    """The first output of every stream; on any error, close them all and raise the first error."""
    try:
        if len(streams) == 1:
            return [await anext(streams[0])]
        results = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    except BaseException:
        await close_all(streams)
        raise
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(streams)
        raise errors[0]
    return list(results)  # type: ignore[arg-type]  # no BaseException left


async def merge_streams(firsts: list[T], streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) for the primed first items, then every later item as it arrives."""
    for index, item in enumerate(firsts):
        yield index, item
    if len(streams) == 1:  # the common case: no tasks, no queue
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await close_all(streams)
        return

    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001  (forwarded to the consumer, which re-raises it)
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` unless the client goes away first: (True, result) or (False, None) after cancelling it.

    Only for non-streaming handlers, whose body has already been read; Starlette's
    StreamingResponse does the same for streams.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        return False, None
    return True, work_task.result()
