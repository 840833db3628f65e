"""One hub per gateway process: one NATS subscription to committed events, many waiters.

Long polls wait on a per-job future; SSE streams own a bounded queue each and share one
keep-alive ticker. The hub never reads the store: it only wakes. Waiters reconcile with the
store themselves (history for gaps, the row for long polls), so a missed or reordered NATS
message costs a read, never an event.

A tenant's events reach the hub from every process's relay, so out of seq order whenever
two relays publish at once (each publishes the rows its own process committed; on
PostgreSQL a relay numbers other processes' events too). Each out-of-order event would
make every stream of the tenant read the store. So the hub puts a tenant's events back in
seq order before its streams see them (``TenantOrder``): an event ahead of the next one
expected waits, at most ``REORDER_HOLD_S``, for those before it; if they do not come (a
lost message, a number retention took), the streams get what arrived and read the gap.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Generic, NamedTuple, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from gateway.sse import KEEPALIVE_FRAME, KEEPALIVE_S, frame, job_frame, tenant_frame
from herald.constants import CHUNK_HEADER, EVENT_SUBJECTS, OUTPUT_LIVE_SUBJECTS
from herald.metrics import Metrics
from schemas import JobEvent
from schemas.jobs import TERMINAL_EVENT_TYPES

log = logging.getLogger("herald.hub")
_decoder = msgspec.json.Decoder(JobEvent)

# How long a tenant's event that arrived ahead of its predecessors waits for them.
REORDER_HOLD_S = 0.1
# How many such events wait at most (then the gap is the streams' to read).
REORDER_MAX_HELD = 1024
# Events handed to streams in a row before the hub lets them run: well below a stream's
# queue (256), so a reader that keeps up is never dropped during a burst.
BURST = 32

T = TypeVar("T")

RESYNC = None  # queued to a subscriber when it must re-read the store (NATS reconnected)


class Framed(NamedTuple):
    """An event and its SSE frame for one kind of stream, built once per event and shared by
    every stream of that kind (a job's streams number frames by version, a tenant's by seq)."""

    event: JobEvent
    frame: bytes


Item = Framed | None | bytes  # an event, RESYNC, or the keep-alive frame


class LiveChunk(NamedTuple):
    """A stored output chunk as JetStream republished it, with its SSE frame (built once)."""

    n: int
    seq: int  # its position in HERALD_OUTPUT
    frame: bytes


OutputItem = LiveChunk | Framed | None | bytes  # a chunk, the job's terminal event, RESYNC, a keep-alive


class Inbox(Generic[T]):
    """One stream's inbox: a list, and one future while its stream waits.

    Overflow drops the stream (it resumes from its last id). A list and a bare future rather
    than an ``asyncio.Queue`` and an ``asyncio.Event`` (four deques, each preallocating a
    600-byte block, even a plain deque would): thousands of idle streams keep this object
    each. Taking from the front of a list moves the rest, at most ``maxsize`` pointers;
    queues are short unless a reader falls behind. Subclasses decide what ``offer`` takes.
    """

    __slots__ = ("key", "items", "overflowed", "on_drop", "_maxsize", "_offered", "_waiter", "_active")

    def __init__(self, key: str, maxsize: int) -> None:
        self.key = key
        self.items: list[T | bytes] = []
        self.overflowed = False  # its queue was full: the stream ends at the next item it takes
        # Called once its queue overflowed (counted): ends its stream now, also one stuck in a
        # send to a reader that stopped reading (gateway.sse.drop_handle).
        self.on_drop: Callable[[], None] | None = None
        self._maxsize = maxsize
        self._offered = 0  # the position of the newest item queued: older ones are copies
        self._waiter: asyncio.Future[None] | None = None
        self._active = False  # its stream wrote something since the hub's last keep-alive tick

    def sent(self) -> None:
        """Its stream wrote something to its client (``keep_alive`` judges silence by this)."""
        self._active = True

    def keep_alive(self) -> None:
        """A tick of the hub's keep-alive ticker: a keep-alive frame if its stream wrote nothing
        since the last one.

        Judged by what the stream wrote (``sent``), not by what was queued: a tenant stream
        with a ``?kind=`` filter takes every event of its tenant and writes only its kind's,
        and was kept silent for as long as other kinds' events flowed. Not when a keep-alive
        is queued already, nor into a full queue: it must not be what overflows a slow reader's."""
        if self._active:
            self._active = False
        elif len(self.items) < self._maxsize and (not self.items or KEEPALIVE_FRAME not in self.items):
            self.items.append(KEEPALIVE_FRAME)
            self._active = True  # an idle stream gets one every KEEPALIVE_S, not one per tick
            self._wake()

    def _put(self, item: T | bytes) -> bool:
        if len(self.items) >= self._maxsize:
            self.overflowed = True
            self._wake()
            return False
        self.items.append(item)
        self._wake()
        return True

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def next(self) -> T | bytes:
        """The next item, or ``KEEPALIVE_FRAME`` (bytes) after a silence."""
        while not self.items:
            await self.wait()
        return self.items.pop(0)

    def wait(self) -> asyncio.Future[None]:
        """A future done once something is queued (or the queue overflowed). The streams
        await it directly, without a coroutine frame per wait: ``while not s.items: await
        s.wait()``, then ``s.items.pop(0)``."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = asyncio.get_running_loop().create_future()
        return waiter


class OutputSubscriber(Inbox["LiveChunk | Framed | None"]):
    """One output stream's inbox (SPEC §8): chunks of one job, and its terminal event.

    Ordered by chunk number: a chunk at or below the highest one queued is a copy (a
    republish after a lost ack) and takes no slot.

    While its stream replays from JetStream (``replaying``) it does not read this queue, so
    a full one says nothing about its reader: what does not fit is left out and noted
    (``missed``), and the stream reads it from JetStream once its replay is done. Dropping the
    stream instead reset a reader that was catching up as fast as it could."""

    __slots__ = ("replaying", "missed")

    def __init__(self, key: str, maxsize: int) -> None:
        super().__init__(key, maxsize)
        self.replaying = False
        self.missed = False

    def offer(self, item: OutputItem) -> bool:
        if isinstance(item, LiveChunk):
            if item.n <= self._offered:
                return True
            self._offered = item.n
        if self.replaying and len(self.items) >= self._maxsize:
            self.missed = True  # every chunk the hub hears is stored, and the end is in the store
            return True
        return self._put(item)


class Subscriber(Inbox["Framed | None"]):
    """One SSE stream's inbox (a job's or a tenant's events).

    An event is queued only if it is further along than every event queued before (version
    for a job's stream, tenant sequence for a tenant's): the same event can reach the hub
    more than once (a relay's catch-up pass may publish a row its own process is publishing
    too, and a publish retried after a lost ack is sent again), and a copy must not take a
    slot. Skipping an older one is safe: the stream already saw a newer event, and a gap it
    saw is filled from the store.
    """

    __slots__ = ("_by_seq",)

    def __init__(self, key: str, maxsize: int, *, by_seq: bool) -> None:
        super().__init__(key, maxsize)
        self._by_seq = by_seq

    def offer(self, item: Framed | None) -> bool:
        if item is not None:
            event = item.event
            position = event.seq if self._by_seq else event.version
            if position <= self._offered:
                return True  # a copy, or older than what it already has
            self._offered = position
        return self._put(item)


class TenantOrder:
    """A tenant's events in seq order, released to ``release`` (its streams).

    ``next`` is the seq expected next: the first event seen sets it. An event below it was
    released already (a copy) or given up on, and is dropped: a stream that needs it finds
    it in the store when it sees the gap. One above it is held until the ones between have
    come, for ``hold_s`` at most."""

    __slots__ = ("next", "held", "_release", "_hold_s", "_timer")

    def __init__(self, release: Callable[[JobEvent], None], *, hold_s: float = REORDER_HOLD_S) -> None:
        self.next = 0
        self.held: dict[int, JobEvent] = {}
        self._release = release
        self._hold_s = hold_s
        self._timer: asyncio.TimerHandle | None = None

    def add(self, event: JobEvent) -> None:
        seq = event.seq
        if self.next == 0:
            self.next = seq
        if seq < self.next:
            return
        if seq > self.next:
            self.held.setdefault(seq, event)
            if len(self.held) > REORDER_MAX_HELD:
                self.give_up()
            elif self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self._hold_s, self.give_up)
            return
        self._release(event)
        self.next = seq + 1
        while self.held and (following := self.held.pop(self.next, None)) is not None:
            self._release(following)
            self.next += 1
        if not self.held:
            self.cancel()

    def give_up(self) -> None:
        """Release what is held, in order, leaving gaps for the streams to read."""
        self.cancel()
        held, self.held = self.held, {}
        for seq in sorted(held):
            self._release(held[seq])
            self.next = seq + 1

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Hub:
    def __init__(self, metrics: Metrics, *, queue_size: int = 256) -> None:
        self._metrics = metrics
        self._queue_size = queue_size
        self._polls: dict[str, set[asyncio.Future[int]]] = defaultdict(set)
        self._job_subs: dict[str, set[Subscriber]] = defaultdict(set)
        self._tenant_subs: dict[str, set[Subscriber]] = defaultdict(set)
        self._tenant_orders: dict[str, TenantOrder] = {}
        self._output_subs: dict[str, set[OutputSubscriber]] = defaultdict(set)
        self._subscription: NatsSubscription | None = None
        self._output_subscription: NatsSubscription | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._burst = 0  # events handed to streams since the hub last let them run

    async def attach(self, nc: NATS) -> None:
        self._subscription = await nc.subscribe(EVENT_SUBJECTS, cb=self._on_message, pending_msgs_limit=1_000_000)
        # Streamed output: one subscription for every output stream of this gateway. JetStream
        # republishes a chunk here only once it is stored, so a reader never sees one that is not.
        self._output_subscription = await nc.subscribe(OUTPUT_LIVE_SUBJECTS, cb=self._on_output,
                                                       pending_msgs_limit=1_000_000)

    async def detach(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for subscription in (self._subscription, self._output_subscription):
            if subscription is not None:
                try:
                    await subscription.unsubscribe()
                except Exception:  # connection already closed
                    pass
        self._subscription = self._output_subscription = None

    async def _on_message(self, message: Msg) -> None:
        try:
            event = _decoder.decode(message.data)
        except msgspec.DecodeError:
            log.error("undecodable event", extra={"subject": message.subject})
            return
        self.publish(event)
        # nats-py hands a burst of messages to this callback back to back, without yielding
        # to the loop in between; yield every BURST messages, so that streams drain their
        # queues while a long burst lasts instead of overflowing (and being dropped as slow
        # readers). Not after each one: a tenant's stream sends what queued since it last
        # woke as one write, and a yield per message made that a write per event.
        self._burst += 1
        if self._burst >= BURST:
            self._burst = 0
            await asyncio.sleep(0)

    async def _on_output(self, message: Msg) -> None:
        streams = self._output_subs.get(message.subject.rpartition(".")[2])
        if streams:
            headers = message.headers or {}
            raw_n, raw_seq = headers.get(CHUNK_HEADER, ""), headers.get("Nats-Sequence", "0")
            if raw_n.isdigit() and raw_seq.isdigit():
                chunk = LiveChunk(int(raw_n), int(raw_seq), frame(raw_n, "output", message.data))
                for subscriber in tuple(streams):
                    if not subscriber.offer(chunk):
                        self._drop_output(subscriber)
        await asyncio.sleep(0)  # as _on_message: let streams drain during a burst

    def _drop_output(self, subscriber: OutputSubscriber) -> None:
        self.unsubscribe(subscriber)
        self._metrics.sse_dropped.labels(reason="queue_full").inc()
        log.warning("slow SSE client dropped", extra={"stream": subscriber.key})
        if subscriber.on_drop is not None:
            subscriber.on_drop()

    def publish(self, event: JobEvent) -> None:
        """Wake everything that waits on this event's job or tenant. Duplicates are fine."""
        for future in self._polls.pop(event.job_id, ()):
            if not future.done():
                future.set_result(event.version)
        job_streams = self._job_subs.get(event.job_id)
        if job_streams:
            self._offer(job_streams, Framed(event, job_frame(event)))
        if event.seq and event.tenant in self._tenant_subs:
            # seq 0: committed here, numbered later (PostgreSQL numbers a tenant's events
            # after commit): its tenant streams get it numbered, from the relay through NATS.
            order = self._tenant_orders.get(event.tenant)
            if order is None:
                order = self._tenant_orders[event.tenant] = TenantOrder(self._to_tenant_streams)
            order.add(event)
        output_streams = self._output_subs.get(event.job_id)
        if output_streams and event.type in TERMINAL_EVENT_TYPES:
            # Without an id: each output stream gives it its own (the last chunk it sent).
            ended = Framed(event, frame(None, event.type, bytes(event.data)))
            for subscriber in tuple(output_streams):
                if not subscriber.offer(ended):
                    self._drop_output(subscriber)

    def _to_tenant_streams(self, event: JobEvent) -> None:
        tenant_streams = self._tenant_subs.get(event.tenant)
        if tenant_streams:
            self._offer(tenant_streams, Framed(event, tenant_frame(event)))

    def _offer(self, group: set[Subscriber], item: Framed) -> None:
        for subscriber in tuple(group):
            if not subscriber.offer(item):
                # Its queue is full: it gets nothing more and its stream ends (it will
                # resume with Last-Event-ID). Counted and logged once per stream.
                self.unsubscribe(subscriber)
                self._metrics.sse_dropped.labels(reason="queue_full").inc()
                log.warning("slow SSE client dropped", extra={"stream": subscriber.key, "job_id": item.event.job_id})
                if subscriber.on_drop is not None:
                    subscriber.on_drop()

    def resync(self) -> None:
        """After a NATS reconnect some events may be missed: make every waiter re-read the store."""
        for futures in list(self._polls.values()):
            for future in futures:
                if not future.done():
                    future.set_result(-1)
        self._polls.clear()
        for order in self._tenant_orders.values():
            order.cancel()
        self._tenant_orders.clear()  # the next event of each tenant sets where it stands
        for group in (*self._job_subs.values(), *self._tenant_subs.values()):
            for subscriber in group:
                subscriber.offer(RESYNC)
        for outputs in self._output_subs.values():
            for output in outputs:
                output.offer(RESYNC)

    # ----- long polls -------------------------------------------------------------------

    async def wait_for_change(self, job_id: str, version: int, timeout: float, reread: Callable[[], Awaitable[int | None]]) -> bool:
        """True when ``job_id`` moved past ``version`` within ``timeout`` (see ``wait_for_version``)."""
        return await self.wait_for_version(job_id, version, timeout, reread) is not None

    async def wait_for_version(self, job_id: str, version: int, timeout: float,
                               reread: Callable[[], Awaitable[int | None]]) -> int | None:
        """The version that ``job_id`` moved to past ``version`` within ``timeout``, or None.

        -1 when it moved but the version is not known (a NATS reconnect, or the job is gone):
        the caller reads the store. ``reread`` gives the stored version; it is called once
        after the waiter is registered, so a change committed between the caller's read and
        now is not missed.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        self._polls[job_id].add(future)
        self._metrics.long_polls.inc()
        try:
            stored = await reread()
            if stored is None or stored != version:
                return -1 if stored is None else stored
            async with asyncio.timeout(timeout):
                while True:
                    seen = await future
                    if seen == -1 or seen > version:
                        return seen
                    future = loop.create_future()  # a late duplicate: keep waiting
                    self._polls[job_id].add(future)
        except TimeoutError:
            return None
        finally:
            self._metrics.long_polls.dec()
            waiters = self._polls.get(job_id)
            if waiters is not None:
                waiters.discard(future)
                if not waiters:
                    del self._polls[job_id]

    # ----- streams ----------------------------------------------------------------------

    def subscribe_job(self, job_id: str) -> Subscriber:
        subscriber = Subscriber(f"job:{job_id}", self._queue_size, by_seq=False)
        self._job_subs[job_id].add(subscriber)
        self._start_ticker()
        return subscriber

    def subscribe_tenant(self, tenant: str) -> Subscriber:
        subscriber = Subscriber(f"tenant:{tenant}", self._queue_size, by_seq=True)
        self._tenant_subs[tenant].add(subscriber)
        self._start_ticker()
        return subscriber

    def subscribe_output(self, job_id: str) -> OutputSubscriber:
        subscriber = OutputSubscriber(f"output:{job_id}", self._queue_size)
        self._output_subs[job_id].add(subscriber)
        self._start_ticker()
        return subscriber

    # One keep-alive ticker for all streams, not a timer per waiting stream (a timer armed
    # and cancelled per event and stream under fan-out). It ticks every KEEPALIVE_S / 2 and
    # gives a keep-alive to each stream that wrote nothing since the previous tick, so a
    # stream is never silent for more than KEEPALIVE_S. It stops while there are none.

    def _start_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().call_later(KEEPALIVE_S / 2, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        if not self._job_subs and not self._tenant_subs and not self._output_subs:
            return
        for group in (*self._job_subs.values(), *self._tenant_subs.values()):
            for subscriber in group:
                subscriber.keep_alive()
        for outputs in self._output_subs.values():
            for output in outputs:
                output.keep_alive()
        self._start_ticker()

    def unsubscribe(self, subscriber: Subscriber | OutputSubscriber) -> None:
        kind, _, key = subscriber.key.partition(":")
        if isinstance(subscriber, OutputSubscriber):
            outputs = self._output_subs.get(key)
            if outputs is not None:
                outputs.discard(subscriber)
                if not outputs:
                    del self._output_subs[key]
            return
        table = self._job_subs if kind == "job" else self._tenant_subs
        group = table.get(key)
        if group is not None:
            group.discard(subscriber)
            if not group:
                del table[key]
                if kind == "tenant" and (order := self._tenant_orders.pop(key, None)) is not None:
                    order.cancel()
