"""The bench's own job kinds, found through ``HERALD_KINDS`` (``bench.handlers:ECHO``,
``bench.handlers:TICKER``; the bench runs from the repository's root, where kinds are
looked up too).

``echo`` is the trivial job of the end-to-end scenario and its peers: it returns
``{"n": n}`` as its JSON result at once (no progress, no file).

``ticker`` streams ``chunks`` output chunks at a steady ``rate`` per second with
``ctx.emit_nowait`` (the way a model streams tokens: it does not wait for each one to be
stored). Each chunk is ``{"i": <1..chunks>, "t": <wall clock at emit>}``, so a reader in
another process can tell how long the chunk took from the handler to it.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from herald.kinds import KindDeclaration
from schemas import JobParams

if TYPE_CHECKING:  # a gateway imports this module for TICKER: it never imports the workers package
    from workers import JobContext

MIN_SLEEP_S = 0.0001  # never a busy loop, even when behind
GATE_TIMEOUT_S = 300.0


class TickerParams(JobParams, kw_only=True):
    chunks: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
    rate: Annotated[float, msgspec.Meta(gt=0, le=100_000)] = 1000.0  # chunks per second
    gate: Annotated[str, msgspec.Meta(max_length=4096)] = ""  # a file to wait for ("": start at once)


async def ticker(ctx: JobContext, params: TickerParams) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    if params.gate:
        async with asyncio.timeout(GATE_TIMEOUT_S):
            while not os.path.exists(params.gate):
                await asyncio.sleep(0.005)
    started = loop.time()
    stored: list[asyncio.Future[None]] = []
    sent = 0
    while sent < params.chunks:
        # Every chunk due by now, each stamped as it is emitted: a tick that wakes late
        # catches up instead of lowering the rate.
        due = min(params.chunks, int((loop.time() - started) * params.rate) + 1)
        while sent < due:
            sent += 1
            stored.append(ctx.emit_nowait({"i": sent, "t": time.time()}))
        if sent < params.chunks:
            await asyncio.sleep(max(0.0, started + sent / params.rate - loop.time(), MIN_SLEEP_S))
    emitting_s = loop.time() - started
    await asyncio.gather(*stored)
    return {"chunks": sent, "emitting_s": round(emitting_s, 3), "stored_s": round(loop.time() - started, 3)}


TICKER = KindDeclaration(
    name="ticker",
    params=TickerParams,
    collection="/tickers",
    handler="bench.handlers:ticker",
    max_attempts=1,  # a failed run is a failed measurement, not one to repeat
    concurrency=1,
    example={"chunks": 1000, "rate": 1000},
    description="Streams timestamped output chunks at a steady rate (the bench's output scenario).",
)


class EchoParams(JobParams, kw_only=True):
    n: Annotated[int, msgspec.Meta(ge=0, le=1_000_000_000)] = 0


async def echo(ctx: JobContext, params: EchoParams) -> dict[str, int]:
    """The trivial job: no progress, no file, a small JSON result (what the peers' tasks do)."""
    return {"n": params.n}


ECHO = KindDeclaration(
    name="echo",
    params=EchoParams,
    collection="/echoes",
    handler="bench.handlers:echo",
    example={"n": 1},
    description="Returns its number as a JSON result at once (the bench's trivial job).",
)
