"""The handler of tests/kinds_fixture.py's EMIT kind (streamed output, SPEC §8)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from workers import ChunkTooLarge, JobContext

log = logging.getLogger("tests.output")
_left_behind: set[asyncio.Task[None]] = set()


async def _emit_once_ended(ctx: JobContext) -> None:
    """A task a handler left behind, emitting after its job's end was recorded."""
    while (job := await ctx.store.get(ctx.job_id)) is not None and not job.terminal:
        await asyncio.sleep(0.02)
    try:
        await ctx.emit({"late": True})
    except RuntimeError as exc:
        log.warning("late emit refused", extra={"job_id": ctx.job_id, "error": str(exc)})
    else:
        log.warning("late emit stored", extra={"job_id": ctx.job_id})


async def emit(ctx: JobContext, params: Any) -> dict[str, Any]:
    if params.sleep_ms:
        await asyncio.sleep(params.sleep_ms / 1000)
    if params.stall_ms and ctx.attempt > 1:
        await asyncio.sleep(params.stall_ms / 1000)
    for i in range(1, params.count + 1):
        chunk = {"i": i, "attempt": ctx.attempt}
        if params.nowait:
            ctx.emit_nowait(chunk)
        else:
            await ctx.emit(chunk)
        if params.pause_ms:
            await asyncio.sleep(params.pause_ms / 1000)
    if params.stall_ms and ctx.attempt == 1:
        time.sleep(params.stall_ms / 1000)  # a handler that blocks its loop: its heartbeat stops too
        await ctx.emit({"i": params.count + 1, "attempt": ctx.attempt})  # the job is the re-run's by now
    refused = []
    for size in params.sizes:
        try:
            await ctx.emit("x" * (size - 2))  # a JSON string: its quotes are the other 2 bytes
        except ChunkTooLarge:
            refused.append(size)
    if params.burst:
        await asyncio.sleep(params.burst_after_ms / 1000)
        for i in range(1, params.burst + 1):
            ctx.emit_nowait({"i": i, "attempt": ctx.attempt})
    if params.late:
        task = asyncio.create_task(_emit_once_ended(ctx))
        _left_behind.add(task)
        task.add_done_callback(_left_behind.discard)
    return {"refused": refused}
