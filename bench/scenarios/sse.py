"""3. SSE fan-out: N subscribers on one job's stream and on the tenant stream, against nginx + nchan.

For each N, a fresh gateway (so its memory growth is the streams'), one queued job, N
subscribers (``GET /jobs/{id}/events`` or ``GET /events``) ready once they have the
``retry:`` line (and, on a job stream, the snapshot). Then ``sse_events`` transitions,
one at a time, committed by the bench's driver through the store and its outbox relay,
the path a worker's transitions take. Latency runs from just before the commit to the
arrival of the event at each subscriber; completeness counts every event at every
subscriber. The baseline is the same client against nginx + nchan (one worker process,
EventSource subscribers on one channel), each message published the moment the
previous one reached everyone, its body the same status JSON Herald sends.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.driver import Driver, step
from bench.scenario import Context, Outcome
from bench.scenarios.fanout import fan_out, held_rss
from bench.subscribers import Subscribers
from bench.systems import API_KEY, TENANT, Herald, Nchan


def _request(port: int, path: str, auth: bool) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Accept: text/event-stream"]
    if auth:
        lines.append(f"Authorization: Bearer {API_KEY}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _herald_case(ctx: Context, herald: Herald, driver: Driver, n: int, stream: str) -> dict[str, Any]:
    await asyncio.to_thread(herald.start_gateway)
    try:
        (job_id,) = await driver.accept(TENANT)
        await driver.drained()
        gateway = herald.gateway()
        rss0 = gateway.rss_kib()
        path = f"/jobs/{job_id}/events" if stream == "job" else "/events"
        with Subscribers(herald.port, _request(herald.port, path, True), n, mode="sse",
                         ready_frames=2 if stream == "job" else 1) as subs:
            ready = await asyncio.to_thread(subs.open)
            rss = await held_rss(gateway, subs, ready, rss0)

            async def publish(k: int) -> float:
                return await driver.transition(job_id, step(k))

            result = await fan_out(subs, ready, ctx.sizes.sse_events, publish, gateway, ctx.sizes.wait_s)
        result["rss_per_stream_kib"] = rss
        result["gateway_rss_mib"] = round(rss0 / 1024, 1)
        result["payload_bytes"] = len((await driver.last_event(job_id)).data)
        return result
    finally:
        await asyncio.to_thread(herald.stop, "gateway")


async def _nchan_case(ctx: Context, n: int, payload: bytes) -> dict[str, Any]:
    nchan = await asyncio.to_thread(Nchan, ctx.procs, ctx.dir(f"sse/nchan-{n}"))
    try:
        channel = f"fanout{n}"
        rss0 = nchan.proc.rss_kib()
        with Subscribers(nchan.port, _request(nchan.port, f"/sub?id={channel}", False), n, mode="sse") as subs:
            await asyncio.to_thread(subs.open)
            deadline = asyncio.get_running_loop().time() + ctx.sizes.wait_s
            while nchan.subscribers(channel) < n and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            ready = nchan.subscribers(channel)
            rss = await held_rss(nchan.proc, subs, ready, rss0)

            async def publish(_k: int) -> float:
                return nchan.publish(channel, payload)

            result = await fan_out(subs, ready, ctx.sizes.sse_events, publish, nchan.proc, ctx.sizes.wait_s)
        result["rss_per_stream_kib"] = rss
        return result
    finally:
        ctx.procs.stop(nchan.proc)


async def _run(ctx: Context, out: Outcome) -> None:
    # The driver claims each case's job as a worker would, but nothing heartbeats it: with the
    # default 30 s timeout the sweeper re-queued an earlier case's job during a later one, and
    # that (correct) job.queued reached the tenant streams as an event the bench did not make.
    herald = await asyncio.to_thread(ctx.herald, "sse", HERALD_HEARTBEAT_TIMEOUT_S="3600")
    herald.data_dir.mkdir(parents=True, exist_ok=True)
    herald_cases: dict[str, Any] = {}
    nchan_cases: dict[str, Any] = {}
    async with Driver(herald.store_settings()) as driver:
        for n in ctx.sizes.sse_n:
            for stream in ("job", "tenant"):
                ctx.say(f"sse: Herald {stream} stream, N={n}")
                herald_cases[f"{stream}/{n}"] = await _herald_case(ctx, herald, driver, n, stream)
            if not ctx.nchan_missing:
                ctx.say(f"sse: nchan, N={n}")
                (job_id,) = await driver.accept(TENANT)
                payload = bytes((await driver.last_event(job_id)).data)
                nchan_cases[str(n)] = await _nchan_case(ctx, n, payload)
    out.herald = herald_cases
    out.baseline = {"cases": nchan_cases}
    for n in ctx.sizes.sse_n:
        base = nchan_cases.get(str(n), {})
        for stream in ("job", "tenant"):
            h = herald_cases[f"{stream}/{n}"]
            case = f"{stream} stream N={n}"
            out.row(case, "p50", h["p50_ms"], base.get("p50_ms"), better="lower", unit="ms")
            out.row(case, "p99", h["p99_ms"], base.get("p99_ms"), better="lower", unit="ms")
            out.row(case, "max", h["max_ms"], base.get("max_ms"), better="lower", unit="ms")
            out.row(case, "completeness", 100 * h["completeness"],
                    100 * base["completeness"] if base else None, better="higher", unit="%")
            out.row(case, "RSS/stream", h["rss_per_stream_kib"], base.get("rss_per_stream_kib"), better="lower",
                    unit="KiB")
    complete = all(c["completeness"] == 1.0 and c["duplicates_or_extra"] == 0 for c in herald_cases.values())
    out.target("SSE: every event to every subscriber", "yes" if complete else "no", complete)
    key_n = 1000 if 1000 in ctx.sizes.sse_n else max(ctx.sizes.sse_n)
    base = nchan_cases.get(str(key_n))
    worst = max(herald_cases[f"{s}/{key_n}"]["p99_ms"] for s in ("job", "tenant"))
    if base:
        out.target(f"SSE p99 <= 2x nchan at N={key_n}", f"{worst:.1f} ms vs {base['p99_ms']:.1f} ms",
                   worst <= 2 * base["p99_ms"])
    else:
        out.target(f"SSE p99 <= 2x nchan at N={key_n}", f"{worst:.1f} ms, nchan n/a", None)
    rss = max(c["rss_per_stream_kib"] for c in herald_cases.values() if c["subscribers"] >= 100) if any(
        c["subscribers"] >= 100 for c in herald_cases.values()) else max(c["rss_per_stream_kib"] for c in herald_cases.values())
    out.target("SSE <= 20 KB per idle stream", f"{rss:.1f} KiB", rss <= 20 * 1000 / 1024)


def run(ctx: Context) -> Outcome:
    out = Outcome("sse", "SSE fan-out: one committed transition to N subscribers",
                  "nginx + nchan EventSource (1 worker), same client")
    if ctx.nchan_missing:
        out.baseline_unavailable(ctx.nchan_missing)
    asyncio.run(_run(ctx, out))
    return out
