"""Measuring one push system: hold N subscribers, make changes one at a time, see who got what when.

Shared by the SSE and long-poll scenarios and by both systems (Herald, nginx + nchan).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from bench.procs import Proc
from bench.stats import latency_summary
from bench.subscribers import Subscribers


async def held_rss(proc: Proc, subs: Subscribers, opened: int, rss_before_kib: int) -> float:
    """Server memory per held connection, in KiB (after a moment for the server to settle)."""
    await asyncio.sleep(0.5)
    return round((proc.rss_kib() - rss_before_kib) / max(1, opened), 2)


async def fan_out(subs: Subscribers, ready: int, events: int, publish: Callable[[int], Awaitable[float]],
                  server: Proc, wait_s: float) -> dict[str, Any]:
    """Publish ``events`` changes (waiting for each to reach every ready subscriber) and measure.

    ``publish(k)`` makes the k-th change and returns the wall clock just before it.
    """
    server_cpu0 = server.cpu_seconds()
    client_cpu0 = await asyncio.to_thread(subs.cpu_seconds)
    starts: list[float] = []
    for k in range(1, events + 1):
        starts.append(await publish(k))
        await asyncio.to_thread(subs.wait_count, k, ready, wait_s)
        await asyncio.sleep(0.05)
    server_cpu = server.cpu_seconds() - server_cpu0
    client_cpu = await asyncio.to_thread(subs.cpu_seconds) - client_cpu0
    result = await asyncio.to_thread(subs.collect)
    latencies: list[float] = []
    delivered = extra = 0
    for times in result.times:
        for k, arrived in enumerate(times[:events]):
            latencies.append((arrived - starts[k]) * 1000)
        delivered += min(len(times), events)
        extra += max(0, len(times) - events)
    expected = subs.n * events
    return {
        "subscribers": subs.n,
        "ready": ready,
        "events": events,
        "delivered": delivered,
        "expected": expected,
        "completeness": round(delivered / expected, 4) if expected else 0.0,
        "duplicates_or_extra": extra,
        **latency_summary(latencies),
        "server_cpu_ms_per_event": round(1000 * server_cpu / events, 1),
        "client_cpu_ms_per_event": round(1000 * client_cpu / events, 1),
        "client_processes": len(subs.procs),
    }


async def long_polls(subs: Subscribers, publish: Callable[[], Awaitable[float]], server: Proc,
                     wait_s: float) -> dict[str, Any]:
    """One change wakes every held poll: latency from the change to each answer's first byte."""
    server_cpu0 = server.cpu_seconds()
    client_cpu0 = await asyncio.to_thread(subs.cpu_seconds)
    started = await publish()
    await asyncio.to_thread(subs.wait_count, 1, subs.n, wait_s)
    server_cpu = server.cpu_seconds() - server_cpu0
    client_cpu = await asyncio.to_thread(subs.cpu_seconds) - client_cpu0
    result = await asyncio.to_thread(subs.collect)
    answered = [t for t in result.answered if t is not None]
    ok = sum(1 for s in result.statuses if s == 200)
    return {
        "polls": subs.n,
        "answered": len(answered),
        "answered_200": ok,
        "completeness": round(ok / subs.n, 4) if subs.n else 0.0,
        **latency_summary((t - started) * 1000 for t in answered),
        "server_cpu_ms": round(1000 * server_cpu, 1),
        "client_cpu_ms": round(1000 * client_cpu, 1),
        "client_processes": len(subs.procs),
    }
