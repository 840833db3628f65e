"""A durable pull consumer read as a stream (herald/pullstream.py), as every notifier reads
the events: several readers share one consumer, and each message reaches one of them as
it comes, not when some reader's batch or timeout runs out."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from herald.pullstream import PullStream
from tests.harness import NatsServer

WAIT_S = 30.0  # how long a reader is willing to wait: far more than any message may take


async def consumer_of(nc: Any, name: str = "readers") -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="EVENTS", subjects=["events.>"]))
    await js.add_consumer("EVENTS", ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT))


async def test_messages_reach_readers_sharing_a_consumer_as_they_come_not_when_a_batch_fills(
        nats_server: NatsServer) -> None:
    """Two readers (two notifiers) wait on one consumer while messages come a few ms apart.
    nats-py's ``fetch`` held them until a batch filled or its timeout ran out (the server
    refuses a second reader's ``no_wait`` probe with ``408 Requests Pending``)."""
    nc = await nats.connect(nats_server.url)
    publisher = await nats.connect(nats_server.url)
    try:
        await consumer_of(nc)
        readers = [PullStream(nc, "EVENTS", "readers", batch=128, expires_s=WAIT_S) for _ in range(2)]
        count = 300
        delays: list[float] = []
        all_came = asyncio.Event()

        async def read(reader: PullStream) -> None:
            while True:
                messages = await reader.next_batch(WAIT_S)
                arrived = time.monotonic()
                delays.extend(arrived - float(message.data) for message in messages)
                await asyncio.sleep(0.001)  # the fan-out's transaction, before the acks
                for message in messages:
                    await message.ack()
                if len(delays) >= count:
                    all_came.set()

        reading = [asyncio.create_task(read(reader)) for reader in readers]
        js = publisher.jetstream()
        for _ in range(count):
            await js.publish("events.t", str(time.monotonic()).encode())
            await asyncio.sleep(0.002)  # a steady trickle, not a burst
        await asyncio.wait_for(all_came.wait(), timeout=2 * WAIT_S)
        for task in reading:
            task.cancel()
        assert len(delays) == count
        assert max(delays) < 5.0, f"a message waited {max(delays):.1f} s for a reader that was waiting"
        for reader in readers:
            await reader.close()
    finally:
        await publisher.close()
        await nc.close()


async def test_readers_sharing_a_consumer_get_every_message_once_in_batches(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await consumer_of(nc)
        js = nc.jetstream()
        for n in range(300):
            await js.publish("events.t", str(n).encode())
        readers = [PullStream(nc, "EVENTS", "readers", batch=64, expires_s=2.0) for _ in range(2)]
        got: list[int] = []
        sizes: list[int] = []

        async def read(reader: PullStream) -> None:
            while len(got) < 300:
                messages = await reader.next_batch(0.5)
                sizes.append(len(messages))
                for message in messages:
                    got.append(int(message.data))
                    await message.ack()

        await asyncio.wait_for(asyncio.gather(*(read(r) for r in readers)), timeout=WAIT_S)
        assert sorted(got) == list(range(300))
        assert max(sizes) > 1 and max(sizes) <= 64
        for reader in readers:
            await reader.close()
    finally:
        await nc.close()


async def test_a_reader_asks_again_when_its_request_was_lost_with_the_server(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        await consumer_of(nc)
        reader = PullStream(nc, "EVENTS", "readers", batch=16, expires_s=1.0)
        assert await reader.next_batch(0.2) == []  # its request is out
        # Killed, the server says nothing: the request dies unanswered. The store stays.
        await asyncio.to_thread(nats_server.stop, signal.SIGKILL)
        await asyncio.to_thread(nats_server.start)
        publisher = await nats.connect(nats_server.url)
        try:
            await publisher.jetstream().publish("events.t", b"after")
        finally:
            await publisher.close()
        messages = await reader.next_batch(WAIT_S)
        assert [m.data for m in messages] == [b"after"]
        await reader.close()
    finally:
        await nc.close()


async def test_a_refused_request_is_asked_again_after_a_pause_not_in_a_busy_loop(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await consumer_of(nc)
        requests: list[str] = []
        publish = nc.publish

        async def counted(subject: str, *args: Any, **kwargs: Any) -> None:  # a spy: the request still goes out
            if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
                requests.append(subject)
            await publish(subject, *args, **kwargs)

        nc.publish = counted  # type: ignore[method-assign]
        reader = PullStream(nc, "EVENTS", "nobody", batch=16, expires_s=5.0)  # no such consumer: 503 at once
        assert await reader.next_batch(1.5) == []
        assert 2 <= len(requests) <= 5, f"{len(requests)} pull requests in 1.5 s to a consumer that is not there"
        await reader.close()
    finally:
        await nc.close()
