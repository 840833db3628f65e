"""Webhook delivery transport: httpx's default transport vs httpx-aiohttp, under the httpx API.

    .venv/bin/python bench/webhook_transport.py [--requests 5000] [--concurrency 50] [--rounds 3]

A receiver (aiohttp.web, answering 204) runs in its own process on 127.0.0.1, so the
sender's event loop only measures the client. Each variant sends the same signed-size
JSON body (about 600 bytes, like a job status payload) with one shared AsyncClient and
connection pooling, the way the notifier does. Prints POST/s per round and the median.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
from aiohttp import web
from httpx_aiohttp import AiohttpTransport

BODY = b'{"type":"job.succeeded","timestamp":"2025-01-01T00:00:00Z","data":' + b'{"x":"' + b"a" * 520 + b'"}}'
HEADERS = {"content-type": "application/json", "webhook-id": "evt_bench", "webhook-timestamp": "1700000000",
           "webhook-signature": "v1," + "A" * 44}


def _serve(port: int) -> None:
    async def hook(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", hook)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _limits(concurrency: int) -> httpx.Limits:
    return httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)


def httpx_default(concurrency: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=_limits(concurrency), timeout=15)


def httpx_aiohttp(concurrency: int) -> httpx.AsyncClient:
    connector = aiohttp.TCPConnector(limit=concurrency)
    session = aiohttp.ClientSession(connector=connector)
    return httpx.AsyncClient(transport=AiohttpTransport(client=session), timeout=15)


async def _run(make: Callable[[int], httpx.AsyncClient], url: str, requests: int, concurrency: int) -> float:
    async with make(concurrency) as client:
        left = requests

        async def one_sender() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                response = await client.post(url, content=BODY, headers=HEADERS)
                assert response.status_code == 204

        await asyncio.gather(*(one_sender() for _ in range(concurrency)))  # warm the pool
        left = requests
        started = time.perf_counter()
        await asyncio.gather(*(one_sender() for _ in range(concurrency)))
        return requests / (time.perf_counter() - started)


async def _wait_listening(port: int) -> None:
    for _ in range(200):
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise RuntimeError("receiver did not start")


async def main(requests: int, concurrency: int, rounds: int) -> None:
    port = _free_port()
    receiver = multiprocessing.Process(target=_serve, args=(port,), daemon=True)
    receiver.start()
    try:
        await _wait_listening(port)
        url = f"http://127.0.0.1:{port}/hook"
        variants: dict[str, Callable[[int], httpx.AsyncClient]] = {
            "httpx default transport": httpx_default,
            "httpx + httpx-aiohttp transport": httpx_aiohttp,
        }
        results: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, make in variants.items():  # interleaved, so machine noise hits both alike
                run: Awaitable[float] = _run(make, url, requests, concurrency)
                results[name].append(await run)
        for name, rates in results.items():
            shown = ", ".join(f"{r:,.0f}" for r in rates)
            print(f"{name:34s} median {statistics.median(rates):8,.0f} POST/s   (rounds: {shown})")
    finally:
        receiver.terminate()
        receiver.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.concurrency, args.rounds))
