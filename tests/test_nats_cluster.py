"""The tests' NatsCluster (Herald's own cluster node config): an R3 stream survives kill -9 of its leader."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from tests.harness import NatsCluster

STREAM = "SURVIVE"


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    cluster = NatsCluster(tmp_path / "cluster")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def publish_until_acked(js: nats.js.JetStreamContext, subject: str, payload: bytes, *, deadline_s: float) -> int:
    """Publish, retrying while the stream has no leader (an election is under way); return the seq."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            ack = await js.publish(subject, payload, timeout=1, headers={"Nats-Msg-Id": payload.decode()})
            return ack.seq
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def test_cluster_forms_with_named_nodes(cluster: NatsCluster) -> None:
    assert cluster.urls == ",".join(f"nats://127.0.0.1:{n.client_port}" for n in cluster.nodes)
    assert [n.name for n in cluster.nodes] == ["n1", "n2", "n3"]
    assert all((n.directory / "nats.conf").exists() for n in cluster.nodes)


def test_r3_stream_survives_kill_9_of_its_leader(cluster: NatsCluster) -> None:
    async def scenario() -> None:
        nc = await nats.connect(servers=cluster.url_list, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        try:
            js = nc.jetstream(timeout=5)
            await js.add_stream(StreamConfig(name=STREAM, subjects=["survive.>"], num_replicas=3,
                                             storage=StorageType.FILE))
            for i in range(5):
                await publish_until_acked(js, "survive.before", f"before-{i}".encode(), deadline_s=10)

            leader = await asyncio.to_thread(cluster.stream_leader, STREAM)
            cluster.kill(leader, signal.SIGKILL)

            # Publishing goes on once the two survivors elect a new leader.
            seq = await publish_until_acked(js, "survive.after", b"after-0", deadline_s=20)
            assert seq == 6
            new_leader = await asyncio.to_thread(cluster.stream_leader, STREAM)
            assert new_leader != leader

            info = await js.stream_info(STREAM)
            assert info.state.messages == 6
            first = await js.get_msg(STREAM, 1)
            assert first.data == b"before-0"

            # The killed node comes back with its store and catches up.
            await asyncio.to_thread(cluster.restart, leader)
            await publish_until_acked(js, "survive.after", b"after-1", deadline_s=20)
            assert (await js.stream_info(STREAM)).state.messages == 7
        finally:
            await nc.close()

    asyncio.run(scenario())
