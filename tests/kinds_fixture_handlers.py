"""Handlers of tests/kinds_fixture.py. Importing this module appends the importing process's
id to $KINDS_TEST_LOG; each echo job appends its start and end."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from workers import JobContext

_LOG = os.environ.get("KINDS_TEST_LOG")


def _note(line: str) -> None:
    if _LOG:
        with open(_LOG, "a") as log:
            log.write(line + "\n")


_note(f"import {os.getpid()}")


async def echo(ctx: JobContext, params: Any) -> dict[str, Any]:
    _note(f"start {ctx.job_id} {time.monotonic()}")
    await ctx.progress(50)
    await asyncio.sleep(params.sleep_ms / 1000)
    _note(f"end {ctx.job_id} {time.monotonic()}")
    return {"echo": params.message, "attempt": ctx.attempt, "kind": ctx.kind}


def not_async(ctx: JobContext, params: Any) -> None:
    return None


async def sized(ctx: JobContext, params: Any) -> dict[str, Any]:
    return {"data": "x" * params.size}


async def partial(ctx: JobContext, params: Any) -> None:
    """Half a result file on disk (flushed) for ``sleep_ms``, then the rest of it."""
    with open(ctx.output, "wb") as out:
        out.write(f"{params.message}\n".encode())
        out.flush()
        await ctx.progress(50)
        await asyncio.sleep(params.sleep_ms / 1000)
        out.write(b"done\n")
