"""AsyncLLM's sleep / wake / pause (engine/sleep.py has the engine's side and the semantics): vLLM's
async calls, each run on AsyncLLM's engine thread between two steps, so the step loop never sees
the pool or the weights change under it. A pause in mode wait (and a sleep in mode wait) returns
once the requests in flight have finished; outputs the calls end (mode abort) reach their streams.
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass
from typing import Any, Callable

from jaxserve.engine.exceptions import EngineSleepingError
from jaxserve.engine.sleep import PauseMode, check_sleep_args

@dataclass
class _Control:
    fn: Callable[[Any], Any]  # run on the engine thread with the LLMEngine
    ready: Callable[[Any], bool] | None  # run once this holds (None: at once)
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class AsyncSleepMixin:
    """AsyncLLM's sleep / wake / pause (async, as vLLM's). The attributes are AsyncLLM's; its loop
    calls `_run_controls()` each turn and `_fail_controls()` when it ends."""

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        check_sleep_args(level=level, mode=mode)
        if mode == "wait":  # held until the requests in flight are done, then asleep
            await self._control(lambda e: e._pause_for_sleep("wait"))
            await self._control(lambda e: e.sleep(level, "wait"), ready=lambda e: e.drained())
        else:
            await self._control(lambda e: e.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        check_sleep_args(tags=tags)
        await self._control(lambda e: e.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def pause_generation(self, *, mode: PauseMode = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool = False) -> None:
        """Returns once paused: for mode wait, once the requests in flight have finished."""
        mode = "wait" if wait_for_inflight_requests else mode  # vLLM's older argument
        check_sleep_args(mode=mode)
        await self._control(lambda e: e.pause_generation(mode, clear_cache))
        if mode == "wait":
            await self._control(lambda e: None, ready=lambda e: e.drained())

    async def resume_generation(self) -> None:
        await self._control(lambda e: e.resume_generation())

    async def is_paused(self) -> bool:
        return self.engine.is_paused()

    async def _control(self, fn: Callable[[Any], Any], ready: Callable[[Any], bool] | None = None) -> Any:
        if self.dead_error is not None:
            raise self.dead_error
        loop = asyncio.get_running_loop()
        control = _Control(fn, ready, loop, loop.create_future())
        self.__dict__.setdefault("_controls_inbox", queue.SimpleQueue()).put(control)
        self._wake.set()
        return await control.future

    def _run_controls(self) -> None:
        """(engine thread) Run the controls that are ready, in order; deliver the outputs they end."""
        inbox = self.__dict__.setdefault("_controls_inbox", queue.SimpleQueue())
        pending = self.__dict__.setdefault("_controls", [])
        while not inbox.empty():
            pending.append(inbox.get_nowait())
        while pending and (pending[0].ready is None or pending[0].ready(self.engine)):
            control = pending.pop(0)
            try:
                result = control.fn(self.engine)
            except Exception as e:  # noqa: BLE001  (the caller's error: its ValueError, EngineSleepingError)
                _settle(control, None, e)
                continue
            for out in result if isinstance(result, list) else []:
                self._deliver(out.request_id, out)
            _settle(control, None if isinstance(result, list) else result, None)

    def _fail_controls(self) -> None:
        """(engine thread, ending) No control waits forever."""
        error = self.dead_error or EngineSleepingError("the engine has shut down")
        pending = self.__dict__.get("_controls", [])
        inbox = self.__dict__.get("_controls_inbox")
        while inbox is not None and not inbox.empty():
            pending.append(inbox.get_nowait())
        for control in pending:
            _settle(control, None, error)
        pending.clear()


def _settle(control: _Control, result: Any, error: BaseException | None) -> None:
    def done() -> None:
        if not control.future.done():
            if error is not None:
                control.future.set_exception(error)
            else:
                control.future.set_result(result)
    try:
        control.loop.call_soon_threadsafe(done)
    except RuntimeError:  # the caller's loop is closed
        pass


class DataParallelSleepMixin:
    """The replicas' front: every call goes to every replica."""

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        await asyncio.gather(*(r.sleep(level, mode) for r in self.replicas))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await asyncio.gather(*(r.wake_up(tags) for r in self.replicas))

    async def is_sleeping(self) -> bool:
        return any([await r.is_sleeping() for r in self.replicas])

    async def pause_generation(self, *, mode: PauseMode = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool = False) -> None:
        await asyncio.gather(*(r.pause_generation(mode=mode, clear_cache=clear_cache,
                                                  wait_for_inflight_requests=wait_for_inflight_requests)
                               for r in self.replicas))

    async def resume_generation(self) -> None:
        await asyncio.gather(*(r.resume_generation() for r in self.replicas))

    async def is_paused(self) -> bool:
        return any([await r.is_paused() for r in self.replicas])
