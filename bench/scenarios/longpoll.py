"""4. Long poll: N held ``GET /jobs/{id}?wait=60`` (``If-None-Match`` the current tag) woken by one transition.

The polls are held once the gateway's ``herald_long_polls`` gauge counts them all; then
the bench's driver commits one transition (through the store and its relay, as a worker
would) and each poll's latency runs from just before that commit to the first byte of
its answer. The baseline is nchan's long-poll subscriber: N held polls on one channel
woken by one publish, same client.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.driver import Driver, step
from bench.scenario import Context, Outcome
from bench.scenarios.fanout import long_polls
from bench.subscribers import Subscribers
from bench.systems import API_KEY, TENANT, Nchan


def _request(port: int, path: str, extra: tuple[str, ...] = ()) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _herald(ctx: Context, n: int) -> dict[str, Any]:
    herald = await asyncio.to_thread(ctx.herald, "longpoll")
    herald.data_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(herald.start_gateway)
    async with Driver(herald.store_settings()) as driver:
        (job_id,) = await driver.accept(TENANT)
        await driver.drained()
        version = (await driver.store.get(job_id)).version  # type: ignore[union-attr]
        request = _request(herald.port, f"/jobs/{job_id}?wait=60",
                           (f"Authorization: Bearer {API_KEY}", f'If-None-Match: W/"{version}"'))
        with Subscribers(herald.port, request, n, mode="longpoll") as subs:
            await asyncio.to_thread(subs.open)
            deadline = asyncio.get_running_loop().time() + ctx.sizes.wait_s
            while herald.metric("herald_long_polls") < n and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            held = int(herald.metric("herald_long_polls"))

            async def publish() -> float:
                return await driver.transition(job_id, step(1))

            result = await long_polls(subs, publish, herald.gateway(), ctx.sizes.wait_s)
    result["held_before"] = held
    await asyncio.to_thread(herald.stop, "gateway")
    return result


async def _nchan(ctx: Context, n: int) -> dict[str, Any]:
    nchan = await asyncio.to_thread(Nchan, ctx.procs, ctx.dir("longpoll/nchan"))
    try:
        channel = "longpoll"
        with Subscribers(nchan.port, _request(nchan.port, f"/poll?id={channel}"), n, mode="longpoll") as subs:
            await asyncio.to_thread(subs.open)
            deadline = asyncio.get_running_loop().time() + ctx.sizes.wait_s
            while nchan.subscribers(channel) < n and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            held = nchan.subscribers(channel)

            async def publish() -> float:
                return nchan.publish(channel, b'{"state": "running"}')

            result = await long_polls(subs, publish, nchan.proc, ctx.sizes.wait_s)
        result["held_before"] = held
        return result
    finally:
        ctx.procs.stop(nchan.proc)


def run(ctx: Context) -> Outcome:
    n = ctx.sizes.longpoll_n
    out = Outcome("longpoll", f"{n} held long polls woken by one transition", "nginx + nchan long-poll (1 worker), same client")
    if ctx.nchan_missing:
        out.baseline_unavailable(ctx.nchan_missing)
    ctx.say(f"longpoll: Herald, {n} polls")
    out.herald = asyncio.run(_herald(ctx, n))
    if not ctx.nchan_missing:
        ctx.say(f"longpoll: nchan, {n} polls")
        out.baseline = asyncio.run(_nchan(ctx, n))
    h, b = out.herald, out.baseline
    case = f"{n} polls"
    out.row(case, "p50", h["p50_ms"], b.get("p50_ms"), better="lower", unit="ms")
    out.row(case, "p99", h["p99_ms"], b.get("p99_ms"), better="lower", unit="ms")
    out.row(case, "max", h["max_ms"], b.get("max_ms"), better="lower", unit="ms")
    out.row(case, "answered", 100 * h["completeness"], 100 * b["completeness"] if b.get("polls") else None,
            better="higher", unit="%")
    if h["completeness"] < 1:
        out.notes.append(f"Herald answered {h['answered_200']} of {n} polls with 200 after the transition")
    return out
