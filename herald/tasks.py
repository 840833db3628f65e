"""Background tasks with an owner: each is named, its end is logged, and it is awaited on stop.

A task that dies with an exception and nobody awaiting it ends silently; readiness then
stays wrong for ever. ``spawn`` makes every end visible in the log (stopped, ended,
failed with its traceback), and ``stop_all`` cancels and awaits them in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("herald.tasks")


def _log_end(task: asyncio.Task[Any]) -> None:
    name = task.get_name()
    if task.cancelled():
        log.info("background task stopped", extra={"task": name})
    elif (exc := task.exception()) is not None:
        log.error("background task failed", exc_info=exc, extra={"task": name})
    else:
        log.info("background task ended", extra={"task": name})


def spawn(coro: Coroutine[Any, Any, None], name: str, owner: list[asyncio.Task[None]]) -> asyncio.Task[None]:
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_log_end)
    owner.append(task)
    return task


async def stop_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel every task (newest first) and wait for each to end."""
    for task in reversed(tasks):
        task.cancel()
    for task in reversed(tasks):
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
