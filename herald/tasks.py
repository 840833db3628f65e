"""Background tasks with an owner: each is named, its end is logged, and it is awaited on stop.

A task that dies with an exception and nobody awaiting it ends silently; readiness then
stays wrong for ever. So every long-lived task of a process is spawned by a ``TaskOwner``,
which logs each end (stopped, ended, failed with its traceback) and, when its block ends,
stops and awaits every task.

A ``TaskOwner`` is an ``AsyncExitStack`` that can also spawn: a process enters its
resources (the store, NATS, a sender) and spawns its tasks on one owner, in the order they
depend on each other, and they are stopped in the reverse order, one at a time, whichever
step failed. So no task outlives what it uses: a task spawned after the store was opened
is awaited before the store closes.

A task ends by cancellation unless it is spawned with ``stop=``: a call that asks it to
finish on its own (the scheduler hands its leases back first), after which it is awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("herald.tasks")

T = TypeVar("T")
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 5.0

Stop = Callable[[], Awaitable[None] | None]


def _log_end(task: asyncio.Task[Any]) -> None:
    name = task.get_name()
    if task.cancelled():
        log.info("background task stopped", extra={"task": name})
    elif (exc := task.exception()) is not None:
        log.error("background task failed", exc_info=exc, extra={"task": name})
    else:
        log.info("background task ended", extra={"task": name})


async def stop(task: asyncio.Task[Any], ask: Stop | None = None) -> None:
    """End ``task`` (``ask`` it to, or cancel it) and wait until it has really ended; its
    exception is raised here, its cancellation is not (a cancellation of the caller is)."""
    if ask is None:
        task.cancel()
    else:
        asked = ask()
        if inspect.isawaitable(asked):
            await asked
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


class TaskOwner(contextlib.AsyncExitStack):
    """A process's (or a component's) resources and background tasks, ended in reverse order."""

    def __init__(self) -> None:
        super().__init__()
        self._closed = False
        self.closing = False  # set when the block starts ending: a late starter must not begin

    def spawn(self, coro: Coroutine[Any, Any, None], name: str, *, stop: Stop | None = None) -> asyncio.Task[None]:
        """Run ``coro`` as the task ``name`` until this owner's block ends (or it ends first)."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"task {name!r} spawned after its owner stopped")
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_end)
        self.push_async_callback(_stop_spawned, task, stop)
        return task

    async def __aexit__(self, *exc_details: Any) -> bool:
        self.closing = True
        try:
            return bool(await super().__aexit__(*exc_details))
        finally:
            self._closed = True


async def _stop_spawned(task: asyncio.Task[None], ask: Stop | None) -> None:
    with contextlib.suppress(Exception):  # logged when it ended (_log_end): the other tasks still stop
        await stop(task, ask)


async def until_done(attempt: Callable[[], Awaitable[T]], what: str, logger: logging.Logger) -> T:
    """``attempt()`` until it returns, each failure logged as a warning naming ``what``, tried
    again after 0.2 s, doubling to 5 s: for what a process reads once at start and cannot run
    without (the URL signing key, the tenant directory). Given up on, a cut connection under
    that one read stopped a worker or notifier, and left a gateway unready for good."""
    delay = RETRY_FIRST_S
    while True:
        try:
            return await attempt()
        except Exception as exc:
            logger.warning("%s failed: %s; retrying in %.1f s", what, exc, delay)
        await asyncio.sleep(delay)
        delay = min(2 * delay, RETRY_MAX_S)
