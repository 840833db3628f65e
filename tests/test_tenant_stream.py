"""A tenant's SSE stream (``GET /events``) over a real SQLite store and the real hub: what
queued since the stream last woke goes out as one write, in seq order, each event once, and
a gap in the middle of that is read from the store without losing or repeating what was
queued after it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator
from pathlib import Path

from gateway.hub import Framed, Hub
from gateway.ratelimit import TenantLimits
from gateway.routes.events import _tenant_stream
from gateway.sse import KEEPALIVE_FRAME, RETRY_FRAME, tenant_frame
from herald.metrics import metrics
from herald.settings import Settings
from herald.storage import build_storage
from herald.storage.ports import JobStore
from herald.tenants import DefaultLimits
from schemas import JobEvent
from tests.harness import SECRET_KEY
from tests.store_contract.support import new_job


class _Services:
    """The parts of ``gateway.services.Services`` a tenant stream uses, real each."""

    def __init__(self, store: JobStore, hub: Hub) -> None:
        self.store, self.hub, self.metrics = store, hub, metrics()
        self.limiter = TenantLimits(DefaultLimits(Settings()))


async def _accept(store: JobStore) -> JobEvent:
    """A new job of tenant t1; its queued event, numbered at commit (SQLite)."""
    event = (await store.accept(new_job("t1"))).event
    assert event is not None and event.seq
    return event


def _seqs(chunk: bytes) -> list[int]:
    return [int(n) for n in re.findall(rb"^id: (\d+)$", chunk, re.MULTILINE)]


async def test_what_queued_together_goes_out_as_one_write_and_a_gap_is_read_once(tmp_path: Path) -> None:
    storage = build_storage(Settings(data_dir=tmp_path / "data", secret_keys=(SECRET_KEY,)))
    await storage.jobs.open()
    try:
        store = storage.jobs
        events = [await _accept(store)]  # seq 1, before the stream opens
        hub = Hub(metrics())
        stream = _tenant_stream(_Services(store, hub), "t1", None, None)  # type: ignore[arg-type]
        assert isinstance(stream, AsyncGenerator)
        assert await anext(stream) == RETRY_FRAME
        reading = asyncio.ensure_future(anext(stream))  # reads where the store is (seq 1), then waits
        await asyncio.sleep(0.05)
        assert not reading.done()
        events += [await _accept(store) for _ in range(4)]  # seq 2-5
        assert [e.seq for e in events] == [1, 2, 3, 4, 5]
        (subscriber,) = hub._tenant_subs["t1"]
        # 3 never reached this gateway: 4 is a gap; 5, queued after it, is in the store's read too
        for event in (events[1], events[3], events[4]):
            assert subscriber.offer(Framed(event, tenant_frame(event)))
        chunk = await asyncio.wait_for(reading, 5)
        assert _seqs(chunk) == [2, 3, 4, 5], "in order, each once, in one write"
        assert chunk == b"".join(tenant_frame(e) for e in events[1:])
        after = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not after.done(), "5, put back after the read, is a copy: nothing more is sent"
        event = await _accept(store)
        assert subscriber.offer(Framed(event, tenant_frame(event)))
        assert _seqs(await asyncio.wait_for(after, 5)) == [6]
        await stream.aclose()
    finally:
        await storage.close()


async def test_a_kind_filtered_stream_gets_its_keep_alive_while_only_other_kinds_flow(tmp_path: Path) -> None:
    """SPEC §8: a keep-alive at least every 15 s, that is at least every other tick of the hub's
    ticker (every 7.5 s). ``GET /events?kind=export`` takes every event of its tenant and writes
    only exports: judged by what was queued, a flow of reports kept it silent for as long as it
    lasted; judged by what it wrote, it gets its keep-alive."""
    storage = build_storage(Settings(data_dir=tmp_path / "data", secret_keys=(SECRET_KEY,)))
    await storage.jobs.open()
    hub = Hub(metrics())
    try:
        store = storage.jobs
        stream = _tenant_stream(_Services(store, hub), "t1", "export", None)  # type: ignore[arg-type]
        assert isinstance(stream, AsyncGenerator)
        assert await anext(stream) == RETRY_FRAME
        (subscriber,) = hub._tenant_subs["t1"]  # subscribed before it sent anything
        reading = asyncio.ensure_future(anext(stream))
        ticks = 0
        while not reading.done() and ticks < 4:
            event = await _accept(store)  # a report: not this stream's kind
            assert event.kind == "report" and subscriber.offer(Framed(event, tenant_frame(event)))
            while subscriber.items and not reading.done():  # until the stream has taken it (and written nothing)
                await asyncio.sleep(0)
            hub._tick()
            ticks += 1
            await asyncio.sleep(0)
        assert await asyncio.wait_for(reading, 5) == KEEPALIVE_FRAME
        assert ticks <= 2, "within two ticks of the hub's ticker: 15 s"
        await stream.aclose()
    finally:
        await hub.detach()
        await storage.close()
