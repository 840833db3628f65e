"""Herald's NATS client writes the commands of a chain of loop turns in one write
(herald/natsclient.py): a worker's ack, the relay's publishes and the next pull request
come a turn or two apart, and each ``sendto`` cost a worker tens of microseconds."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats
import uvloop

from herald import jetstream
from herald.natsclient import COALESCE_TURNS
from herald.settings import Settings
from tests.harness import NatsServer


def count_writes(nc: Any) -> list[int]:
    """Each write the client makes to its socket, by the number of commands in it (a spy: the
    bytes still go to the real server)."""
    writes: list[int] = []
    transport = nc._transport
    writelines = transport.writelines

    def counted(payload: list[bytes]) -> None:
        if payload:  # nats-py also "writes" an empty queue (its PING counts in the queue's size)
            writes.append(len(payload))
        writelines(payload)

    transport.writelines = counted
    return writes


async def test_commands_of_consecutive_turns_leave_in_one_write(tmp_path: Path) -> None:
    """On asyncio's loop (the tests' own, and any embedder's)."""
    await _one_write_per_chain(tmp_path)


def test_commands_of_consecutive_turns_leave_in_one_write_on_uvloop(tmp_path: Path) -> None:
    """On uvloop, which workers and notifiers run on (``launcher.cli.run_component``) as the
    gateway does: it keeps its queue of due callbacks out of reach, so the flusher always waits."""
    loop = uvloop.new_event_loop()
    try:
        assert not hasattr(loop, "_ready")  # else this would test the other path
    finally:
        loop.close()
    uvloop.run(_one_write_per_chain(tmp_path))


async def _one_write_per_chain(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        listener = await nats.connect(server.url)
        received: list[bytes] = []
        all_came = asyncio.Event()

        async def arrived(msg: Any) -> None:
            received.append(msg.data)
            if len(received) == COALESCE_TURNS + 1:
                all_came.set()

        await listener.subscribe("chain", cb=arrived)
        await listener.flush()

        nc = await jetstream.connect(Settings(data_dir=tmp_path, nats_url=server.url), "test")
        await nc.flush()
        for _ in range(COALESCE_TURNS + 1):  # the flush's own wake of the flusher is over (uvloop's waits)
            await asyncio.sleep(0)
        writes = count_writes(nc)
        # One command per turn, as a chain of tasks makes them (the ack, then the relay's publish...).
        for n in range(COALESCE_TURNS + 1):
            await nc.publish("chain", str(n).encode())
            await asyncio.sleep(0)
        await asyncio.wait_for(all_came.wait(), timeout=10)
        assert received == [str(n).encode() for n in range(COALESCE_TURNS + 1)]  # all sent, in order
        assert writes == [COALESCE_TURNS + 1], writes  # in one write

        # flush() writes what is queued before its PING (nats-py writes the PING at once, ahead
        # of the queue): its PONG still means the server has read every earlier publish.
        writes.clear()
        received.clear()
        all_came.clear()
        for n in range(COALESCE_TURNS + 1):
            await nc.publish("chain", str(n).encode())
        await asyncio.wait_for(nc.flush(), timeout=10)
        assert writes == [COALESCE_TURNS + 1], writes  # before the PING (written apart from the queue)
        await asyncio.wait_for(all_came.wait(), timeout=10)
        await nc.close()
        await listener.close()
    finally:
        server.stop()
