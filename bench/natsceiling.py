"""The JetStream ceiling with nats-py on the same nats-server: publish+ack, pull+ack, and both at once.

One stream with file storage (as Herald's), messages of ``size`` bytes (a job message is
smaller, an event about this size). The publisher keeps a window of 256 publishes
awaiting their PubAck (as Herald's relay does); the consumer fetches batches of 256 from
a durable pull consumer and acks each message (as workers and the notifier do). The
pipeline runs publisher and consumer in two processes at once, the way a gateway and a
worker share the server; its rate is messages consumed per second from the first
publish to the last ack.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import resource
import time
from typing import Any

_CTX = multiprocessing.get_context("spawn")
WINDOW = 256
STREAM = "BENCH_CEILING"


async def _connect(url: str) -> Any:
    import nats

    return await nats.connect(url, pending_size=64 * 1024 * 1024)


async def _publish(url: str, subject: str, total: int, size: int) -> tuple[float, float]:
    nc = await _connect(url)
    js = nc.jetstream()
    payload = b"x" * size
    started = time.time()
    for offset in range(0, total, WINDOW):
        await asyncio.gather(*(js.publish(subject, payload) for _ in range(min(WINDOW, total - offset))))
    finished = time.time()
    await nc.drain()
    return started, finished


async def _consume(url: str, durable: str, total: int, ready: Any = None) -> tuple[float, float]:
    nc = await _connect(url)
    js = nc.jetstream()
    sub = await js.pull_subscribe_bind(durable, STREAM)
    if ready is not None:
        ready.send("ready")
    got, first = 0, None
    while got < total:
        try:
            messages = await sub.fetch(WINDOW, timeout=5)
        except Exception:
            if first is not None:
                break
            continue
        first = first or time.time()
        for message in messages:
            await message.ack()
        got += len(messages)
    finished = time.time()
    await nc.drain()
    return first or finished, finished


async def _setup(url: str) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

    nc = await _connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=["ceiling.>"], storage=StorageType.FILE))
    for durable, subject in (("solo", "ceiling.solo"), ("pipe", "ceiling.pipe")):
        await js.add_consumer(STREAM, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
                                                     filter_subject=subject, max_ack_pending=100_000))
    await nc.drain()


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pipeline_consumer(conn: Any, url: str, total: int) -> None:
    first, last = asyncio.run(_consume(url, "pipe", total, ready=conn))
    conn.send({"first": first, "last": last, "cpu_s": _cpu()})


def _pipeline_publisher(conn: Any, url: str, total: int, size: int) -> None:
    started, finished = asyncio.run(_publish(url, "ceiling.pipe", total, size))
    conn.send({"started": started, "finished": finished, "cpu_s": _cpu()})


def _solo(conn: Any, url: str, total: int, size: int) -> None:
    async def main() -> dict[str, Any]:
        await _setup(url)
        p0, p1 = await _publish(url, "ceiling.solo", total, size)
        c0, c1 = await _consume(url, "solo", total)
        return {"publish_rate": round(total / (p1 - p0), 1), "pull_rate": round(total / (c1 - c0), 1)}

    conn.send(asyncio.run(main()))


def measure(url: str, total: int, size: int = 600) -> dict[str, Any]:
    """Publish-only and pull-only rates (one process), then the two-process pipeline rate."""
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_solo, args=(child, url, total, size), daemon=True)
    proc.start()
    solo = parent.recv()
    proc.join(10)
    c_parent, c_child = _CTX.Pipe()
    p_parent, p_child = _CTX.Pipe()
    consumer = _CTX.Process(target=_pipeline_consumer, args=(c_child, url, total), daemon=True)
    consumer.start()
    assert c_parent.recv() == "ready"
    publisher = _CTX.Process(target=_pipeline_publisher, args=(p_child, url, total, size), daemon=True)
    publisher.start()
    pub, con = p_parent.recv(), c_parent.recv()
    for proc in (consumer, publisher):
        proc.join(10)
    wall = con["last"] - pub["started"]
    return {**solo, "pipeline_rate": round(total / wall, 1) if wall > 0 else 0.0, "messages": total,
            "message_bytes": size, "client_cpu_pct": round(100 * (pub["cpu_s"] + con["cpu_s"]) / wall, 1)}
