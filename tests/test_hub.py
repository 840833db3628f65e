"""The hub's SSE inbox (one deque, one future) and its one keep-alive ticker for all streams."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from gateway import hub as hub_module
from gateway.hub import RESYNC, Framed, Hub, Subscriber
from gateway.sse import KEEPALIVE_FRAME
from herald.metrics import metrics
from schemas import JobEvent


def _event(version: int, seq: int = 0) -> Framed:
    return Framed(JobEvent(job_id="j", tenant="t", kind="report", type="job.progress", version=version, seq=seq or version,
                    at="2026-01-01T00:00:00Z", data=msgspec.Raw(b"{}")), b"")


async def test_a_waiting_stream_is_woken_by_an_offer_and_takes_items_in_order() -> None:
    subscriber = Subscriber("job:j", 8, by_seq=False)
    waiting = asyncio.ensure_future(subscriber.next())
    await asyncio.sleep(0)
    assert not waiting.done()
    assert subscriber.offer(_event(1))
    assert (await asyncio.wait_for(waiting, 1)).event.version == 1  # type: ignore[union-attr]
    assert subscriber.offer(_event(2)) and subscriber.offer(_event(2)), "a copy is accepted and not queued"
    assert subscriber.offer(RESYNC)
    assert [item.event.version for item in [await subscriber.next()]] == [2]  # type: ignore[union-attr]
    assert await subscriber.next() is RESYNC
    assert not subscriber.items


async def test_a_full_inbox_overflows_and_wakes_its_stream() -> None:
    subscriber = Subscriber("tenant:t", 2, by_seq=True)
    assert subscriber.offer(_event(1)) and subscriber.offer(_event(2))
    assert not subscriber.offer(_event(3))
    assert subscriber.overflowed and len(subscriber.items) == 2


async def test_a_cancelled_wait_leaves_the_inbox_usable() -> None:
    subscriber = Subscriber("job:j", 8, by_seq=False)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await subscriber.next()
    assert subscriber.offer(_event(1))
    assert (await asyncio.wait_for(subscriber.next(), 1)).event.version == 1  # type: ignore[union-attr]


def test_keep_alives_only_after_a_tick_in_which_the_stream_wrote_nothing() -> None:
    subscriber = Subscriber("job:j", 3, by_seq=False)
    subscriber.keep_alive()
    assert list(subscriber.items) == [KEEPALIVE_FRAME], "silent since it opened"
    subscriber.items.clear()
    subscriber.keep_alive()
    assert not subscriber.items, "the keep-alive it was given counts as something sent"
    subscriber.keep_alive()
    assert list(subscriber.items) == [KEEPALIVE_FRAME]
    subscriber.keep_alive()
    subscriber.keep_alive()
    assert list(subscriber.items) == [KEEPALIVE_FRAME], "never a second one while one waits"
    subscriber.items.clear()
    assert subscriber.offer(_event(1))
    subscriber.items.clear()
    subscriber.sent()  # its stream wrote the event
    subscriber.keep_alive()
    assert not subscriber.items, "something written since the last tick"
    assert subscriber.offer(_event(2))
    subscriber.items.clear()  # taken, and not written (a tenant stream's ?kind= filter)
    subscriber.keep_alive()
    subscriber.keep_alive()
    assert list(subscriber.items) == [KEEPALIVE_FRAME], "what was queued and not written is silence"
    assert subscriber.offer(_event(3))
    subscriber.keep_alive()
    subscriber.keep_alive()
    assert list(subscriber.items)[0] == KEEPALIVE_FRAME and len(subscriber.items) == 2
    full = Subscriber("job:k", 1, by_seq=False)
    assert full.offer(_event(1))
    full.keep_alive()
    full.keep_alive()
    assert not full.overflowed, "a keep-alive never overflows a slow reader's queue"


async def test_one_ticker_gives_every_silent_stream_a_keep_alive_and_stops_without_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_module, "KEEPALIVE_S", 0.1)
    hub = Hub(metrics())
    streams = [hub.subscribe_job("a"), hub.subscribe_job("a"), hub.subscribe_tenant("t")]
    got = await asyncio.wait_for(asyncio.gather(*(s.next() for s in streams)), 2)
    assert got == [KEEPALIVE_FRAME] * 3
    for subscriber in streams:
        hub.unsubscribe(subscriber)
    await asyncio.sleep(0.15)
    assert hub._ticker is None, "no streams, no ticker"
    again = hub.subscribe_tenant("t")
    assert await asyncio.wait_for(again.next(), 2) == KEEPALIVE_FRAME
    await hub.detach()


async def test_one_frame_per_event_and_kind_of_stream_shared_by_all_its_streams() -> None:
    hub = Hub(metrics())
    jobs = [hub.subscribe_job("j") for _ in range(3)]
    tenants = [hub.subscribe_tenant("t") for _ in range(2)]
    hub.publish(_event(4, seq=17).event)
    job_items = [s.items.pop(0) for s in jobs]
    tenant_items = [s.items.pop(0) for s in tenants]
    assert all(item is job_items[0] for item in job_items) and all(item is tenant_items[0] for item in tenant_items)
    assert job_items[0].frame == b"id: 4\nevent: job.progress\ndata: {}\n\n"  # type: ignore[union-attr]
    assert tenant_items[0].frame == b"id: 17\nevent: job.progress\ndata: {}\n\n"  # type: ignore[union-attr]
    await hub.detach()


async def test_an_unnumbered_event_wakes_its_jobs_streams_and_not_its_tenants() -> None:
    """PostgreSQL numbers a tenant's events after commit: the committing gateway's own event
    (seq 0) goes to its job's streams at once, to its tenant's streams once numbered (NATS)."""
    hub = Hub(metrics())
    job, tenant = hub.subscribe_job("j"), hub.subscribe_tenant("t")
    unnumbered = msgspec.structs.replace(_event(4).event, seq=0)
    hub.publish(unnumbered)
    assert [item.event for item in job.items] == [unnumbered]  # type: ignore[union-attr]
    assert tenant.items == []
    hub.publish(msgspec.structs.replace(unnumbered, seq=9))
    assert [item.event.seq for item in tenant.items] == [9]  # type: ignore[union-attr]
    assert len(job.items) == 1, "the numbered copy is the same version: not queued twice"
    await hub.detach()


def _numbered(seq: int) -> JobEvent:
    return msgspec.structs.replace(_event(1).event, seq=seq, job_id=f"j{seq}")


async def test_a_tenants_events_reach_its_streams_in_seq_order_whichever_relay_published_first() -> None:
    """Two relays' events interleave on NATS; the tenant's streams get them in seq order,
    with no gap to read from the store, and copies are dropped."""
    hub = Hub(metrics())
    stream = hub.subscribe_tenant("t")
    for seq in (1, 2, 5, 3, 6, 4, 4, 2, 7):
        hub.publish(_numbered(seq))
    assert [item.event.seq for item in stream.items] == [1, 2, 3, 4, 5, 6, 7]  # type: ignore[union-attr]
    await hub.detach()


async def test_a_gap_that_is_not_filled_is_released_after_the_hold() -> None:
    """A lost message (or a number retention took): the events after it wait at most the
    hold, then the streams get them and read the gap from the store."""
    hub = Hub(metrics())
    stream = hub.subscribe_tenant("t")
    for seq in (1, 3, 4):
        hub.publish(_numbered(seq))
    assert [item.event.seq for item in stream.items] == [1]  # type: ignore[union-attr]
    await asyncio.sleep(hub_module.REORDER_HOLD_S * 3)
    assert [item.event.seq for item in stream.items] == [1, 3, 4]  # type: ignore[union-attr]
    hub.publish(_numbered(2))  # too late: the stream read it with the gap
    hub.publish(_numbered(5))
    assert [item.event.seq for item in stream.items] == [1, 3, 4, 5]  # type: ignore[union-attr]
    await hub.detach()


async def test_a_tenant_without_streams_keeps_no_order_and_a_reconnect_forgets_it() -> None:
    hub = Hub(metrics())
    hub.publish(_numbered(3))
    assert hub._tenant_orders == {}
    stream = hub.subscribe_tenant("t")
    hub.publish(_numbered(5))  # the first one seen sets where the tenant stands
    hub.publish(_numbered(7))  # held: 6 has not come
    hub.resync()  # after a NATS reconnect every stream re-reads the store
    assert hub._tenant_orders == {}
    hub.publish(_numbered(9))
    assert [item.event.seq if item is not None else None for item in stream.items] == [5, None, 9]  # type: ignore[union-attr]
    hub.unsubscribe(stream)
    assert hub._tenant_orders == {}
    await hub.detach()
