"""The handler of tests/kinds_fixture.py's EMIT kind (streamed output, SPEC §8)."""

from __future__ import annotations

import asyncio
from typing import Any

from workers import ChunkTooLarge, JobContext


async def emit(ctx: JobContext, params: Any) -> dict[str, Any]:
    if params.sleep_ms:
        await asyncio.sleep(params.sleep_ms / 1000)
    for i in range(1, params.count + 1):
        chunk = {"i": i, "attempt": ctx.attempt}
        if params.nowait:
            ctx.emit_nowait(chunk)
        else:
            await ctx.emit(chunk)
        if params.pause_ms:
            await asyncio.sleep(params.pause_ms / 1000)
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
    return {"refused": refused}
