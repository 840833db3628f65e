"""5. Webhooks: deliveries/s and latency to a receiver that verifies signatures, against raw signed POSTs.

Herald: a gateway and a notifier; ``webhook_endpoints`` endpoints registered through the
API, all on the bench's receiver (so the notifier may keep its full 64 attempts in
flight: 8 per endpoint). With the notifier stopped, the driver accepts
``webhook_events`` jobs (each a ``job.queued`` event for every endpoint) and waits until
its relay published them; then the notifier starts and drains the backlog: fetch,
fan-out transaction, claims, signed POSTs, outcome transactions. Deliveries/s runs from
the first delivery's arrival to the last; the attempt latencies are the notifier's own
(``webhook_attempts.latency_ms``). The baselines send the same number of signed POSTs,
with the same body, to the same receiver, from one process at 64 in flight.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import msgspec

from bench import rawsend
from bench.driver import Driver
from bench.procs import BenchError, CpuMeter, free_port, http_post_json, wait_until
from bench.receiver import Receiver, new_secret
from bench.scenario import Context, Outcome
from bench.stats import latency_summary
from bench.systems import AUTH, TENANT, Herald
from schemas.webhooks import WebhookPayload


def _register(herald: Herald, url: str, event_types: list[str] | None = None) -> str:
    document: dict[str, Any] = {"url": url}
    if event_types is not None:
        document["event_types"] = event_types
    status, body = http_post_json(herald.base + "/webhooks", document, AUTH)
    if status != 201:
        raise BenchError(f"registering a webhook answered {status}: {body}")
    return str(body["secret"])  # type: ignore[index]


async def _attempt_latencies(herald: Herald, since: float) -> list[float]:
    """The notifier's own record of each attempt's latency (``webhook_attempts``), from the store."""
    if herald.database_url:
        import asyncpg

        conn = await asyncpg.connect(herald.database_url)
        try:
            rows = await conn.fetch("SELECT latency_ms FROM webhook_attempts WHERE at >= $1", since)
        finally:
            await conn.close()
        return [row[0] for row in rows]
    with sqlite3.connect(f"file:{herald.db_path}?mode=ro", uri=True) as conn:
        return [row[0] for row in conn.execute("SELECT latency_ms FROM webhook_attempts WHERE at >= ?", (since,))]


async def _herald(ctx: Context, herald: Herald, receiver: Receiver, endpoints: int) -> dict[str, Any]:
    sizes = ctx.sizes
    async with Driver(herald.store_settings()) as driver:
        # One event through the whole path first: the endpoints, receiver and notifier work.
        await driver.accept(TENANT)
        await asyncio.to_thread(wait_until, lambda: receiver.count() >= endpoints, timeout=30,
                                what="first webhook deliveries")
        receiver.reset()
        await asyncio.to_thread(herald.stop, "notifier")
        job_ids = await driver.accept(TENANT, sizes.webhook_events)
        if not await driver.drained(60):
            raise BenchError("the driver's relay did not publish the seeded events")
        payload = await driver.last_event(job_ids[0])
        body = msgspec.json.encode(WebhookPayload(type=payload.type, timestamp=payload.at, data=payload.data))
    expected = sizes.webhook_events * endpoints
    since = time.time()
    notifier = await asyncio.to_thread(herald.start_notifier)
    meter = CpuMeter({"notifier": notifier, "nats": herald.nats.proc, **ctx.store_meters()}).start()
    await asyncio.to_thread(wait_until, lambda: receiver.count() >= expected, timeout=sizes.wait_s,
                            what=f"{expected} webhook deliveries", interval=0.1)
    cpu = meter.stop()
    stats = receiver.stats()
    arrivals = [r[0] for r in stats["records"]]
    unique = {(r[1], r[6]) for r in stats["records"]}
    wall = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return {
        "expected": expected,
        "delivered": len(arrivals),
        "unique": len(unique),
        "invalid_signatures": stats["invalid"],
        "rate": round((len(arrivals) - 1) / wall, 1) if wall else 0.0,
        "attempt_latency": latency_summary(await _attempt_latencies(herald, since)),
        "cpu_pct": cpu,
        "receiver_cpu_s": round(stats["cpu_s"], 2),
        "body": body,
    }


def run(ctx: Context) -> Outcome:
    sizes = ctx.sizes
    endpoints = sizes.webhook_endpoints
    out = Outcome("webhooks", f"signed webhook deliveries ({endpoints} endpoints, verifying receiver)",
                  f"raw signed POSTs, one process, {sizes.webhook_concurrency} in flight: aiohttp (ratio), httpx")
    herald = ctx.herald("webhooks")
    herald.start_gateway()
    herald.start_notifier()
    port = free_port()
    secrets = {f"e{i}": _register(herald, f"http://127.0.0.1:{port}/hook/e{i}") for i in range(endpoints)}
    secrets["raw"] = new_secret()
    with Receiver(secrets, processes=2, port=port) as receiver:
        ctx.say(f"webhooks: Herald drains {sizes.webhook_events} events x {endpoints} endpoints")
        h = asyncio.run(_herald(ctx, herald, receiver, endpoints))
        body = h.pop("body")
        raw: dict[str, Any] = {}
        for client in rawsend.CLIENTS:
            ctx.say(f"webhooks: raw {client}")
            receiver.reset()
            result = rawsend.send(client, receiver.url("raw"), secrets["raw"], body, total=h["expected"],
                                  concurrency=sizes.webhook_concurrency)
            result["receiver_cpu_s"] = round(receiver.stats()["cpu_s"], 2)
            raw[client] = result
    out.herald = h
    out.baseline = raw
    aio, hx = raw["aiohttp"], raw["httpx"]
    case = f"{h['expected']:,} deliveries"
    out.row(case, "deliveries/s vs aiohttp", h["rate"], aio["rate"], better="higher", unit="/s")
    out.row(case, "deliveries/s vs httpx", h["rate"], hx["rate"], better="higher", unit="/s")
    out.row(case, "deliveries/s vs httpx-aiohttp", h["rate"], raw["httpx-aiohttp"]["rate"], better="higher", unit="/s")
    out.row(case, "attempt p50 vs aiohttp", h["attempt_latency"]["p50_ms"], aio["p50_ms"], better="lower", unit="ms")
    out.row(case, "attempt p99 vs aiohttp", h["attempt_latency"]["p99_ms"], aio["p99_ms"], better="lower", unit="ms")
    share = h["rate"] / aio["rate"] if aio["rate"] else 0.0
    out.target("webhook deliveries/s >= 50 % of raw aiohttp", f"{100 * share:.0f} %", share >= 0.5)
    if h["delivered"] != h["expected"] or h["invalid_signatures"]:
        out.notes.append(f"Herald: {h['delivered']} of {h['expected']} delivered, "
                         f"{h['invalid_signatures']} failed verification")
    return out
