"""The webhook baselines: raw signed POSTs to the same receiver, from one process like one notifier.

Three clients, each with one pooled session and ``concurrency`` requests in flight:
httpx's default transport, httpx over the ``httpx-aiohttp`` transport (what the notifier
uses), and plain aiohttp. Every request is signed the Standard Webhooks way (HMAC-SHA256
over ``id.timestamp.body``, a fresh ``webhook-id`` each), with the headers the notifier
sends and the body it would send for the same event.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import resource
import time
from typing import Any

from bench.receiver import sign
from bench.stats import latency_summary

_CTX = multiprocessing.get_context("spawn")
CLIENTS = ("httpx", "httpx-aiohttp", "aiohttp")


async def _send_all(client: str, url: str, secret: str, body: bytes, total: int, concurrency: int) -> dict[str, Any]:
    import aiohttp
    import httpx
    from httpx_aiohttp import AiohttpTransport

    latencies: list[float] = []
    errors = 0
    left = total

    def headers(i: int) -> dict[str, str]:
        msg_id = f"evt_raw.{i}"
        ts = int(time.time())
        return {"content-type": "application/json", "user-agent": "Herald/bench", "webhook-id": msg_id,
                "webhook-timestamp": str(ts), "webhook-signature": sign(secret, msg_id, ts, body)}

    async def worker(post: Any) -> None:
        nonlocal left, errors
        while left > 0:
            left -= 1
            started = time.perf_counter()
            try:
                status = await post(headers(left))
            except Exception:
                errors += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)
            if status >= 300:
                errors += 1

    async def run(post: Any) -> float:
        nonlocal left
        left = min(total, concurrency * 4)  # warm the pool
        await asyncio.gather(*(worker(post) for _ in range(concurrency)))
        latencies.clear()
        left = total
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(post) for _ in range(concurrency)))
        return time.perf_counter() - t0

    if client == "aiohttp":
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            async def post(h: dict[str, str]) -> int:
                async with session.post(url, data=body, headers=h) as response:
                    await response.read()
                    return response.status
            wall = await run(post)
    else:
        if client == "httpx":
            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            http = httpx.AsyncClient(limits=limits, timeout=15)
        else:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
            http = httpx.AsyncClient(transport=AiohttpTransport(client=session), timeout=15)
        async with http:
            async def post(h: dict[str, str]) -> int:
                response = await http.post(url, content=body, headers=h)
                return response.status_code
            wall = await run(post)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"client": client, "sent": len(latencies), "errors": errors, "rate": round(len(latencies) / wall, 1),
            **latency_summary(latencies), "cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall}


def _child(conn: Any, args: tuple[Any, ...]) -> None:
    try:
        # The default event loop, as in ``herald notifier`` (it does not use uvloop).
        conn.send(asyncio.run(_send_all(*args)))
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def send(client: str, url: str, secret: str, body: bytes, *, total: int, concurrency: int) -> dict[str, Any]:
    """``total`` signed POSTs with ``client`` in a process of its own."""
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_child, args=(child, (client, url, secret, body, total, concurrency)), daemon=True)
    proc.start()
    try:
        result = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if "error" in result:
        raise RuntimeError(f"{client} sender failed: {result['error']}")
    return result
