"""The outbox relay: publishes committed outbox rows to JetStream, deletes them after the PubAck.

Every process that commits transitions runs one, woken right after its own commits, and
publishes the rows its own process committed, so events reach NATS in milliseconds and
each row is published once (when every relay published the whole outbox, each event
reached NATS 1.6-1.8 times under load, and every gateway's hub received every copy).
A row left behind by a process that died is older than a sweep interval: every relay's
periodic pass publishes those, whoever committed them. Publishing the same row twice is
harmless: the message id makes JetStream drop the repeat, and every consumer is
idempotent by job id and version.

A ``quiet`` event (one no webhook target wanted as it committed, ``herald.constants``) has no
durable reader: it goes out on core NATS to the gateways' hubs, not into a stream, and its
row is deleted once a flush's PONG says the server has read it, the same point a PubAck
marks for the hubs (a hub is a core subscriber either way, and fills what it missed from the
store).

Each message carries its job's W3C trace context as ``traceparent``/``tracestate``
headers (``herald.tracing``): with tracing on, the context of its publish span.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NATS

from herald import tracing
from herald.constants import MSG_ID_HEADER, is_live_only
from herald.storage.ports import JobStore, OutboxRow

log = logging.getLogger("herald.relay")



FINISH_S = 6.0  # the last pass at shutdown, all tries: well within herald up's 15 s per process


class Relay:
    def __init__(self, store: JobStore, nc: NATS, *, sweep_interval_s: float, batch: int = 256,
                 publish_timeout_s: float = 5.0) -> None:
        self._store = store
        self._timeout_s = publish_timeout_s
        self._nc = nc
        self._js = nc.jetstream()
        self._sweep_interval_s = sweep_interval_s
        self._batch = batch
        self._wake = asyncio.Event()
        store.on_commit(lambda _job, _event: self.kick())

    def kick(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Publish until cancelled. A failed publish (NATS away) backs off and retries."""
        backoff = 0.1
        last_pass = float("-inf")  # the first pass at start: rows a previous run left behind
        self._wake.set()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._sweep_interval_s)
            self._wake.clear()
            try:
                while await self.publish_pending() >= self._batch:
                    pass
                if time.monotonic() - last_pass >= self._sweep_interval_s:  # also under steady load
                    while await self.publish_pending(stale_after_s=self._sweep_interval_s) >= self._batch:
                        pass
                    last_pass = time.monotonic()
                backoff = 0.1
            except Exception as exc:  # NATS unreachable, timeouts: rows stay in the outbox
                log.warning("relay publish failed, will retry: %s", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self._wake.set()

    async def finish(self) -> None:
        """The last pass at shutdown, once ``run`` has stopped (two passes at once publish the
        same rows, and a replicated stream answers the second "duplicate message id is in
        process", not a PubAck): what this process committed goes out now. What does not
        stays in the outbox for the next relay's sweep; a stopping process does not fail on it.
        A publish the loop's cancellation cut short may still be in the stream's hands: a
        moment later its repeat is a plain duplicate, so a failed pass is tried twice more.
        All of it within ``FINISH_S``: three publishes timing out (5 s each) outlasted the 15 s
        that ``herald up`` gives a stopping process, which was then killed."""
        try:
            async with asyncio.timeout(FINISH_S):
                for tries_left in (2, 1, 0):
                    try:
                        while await self.publish_pending() >= self._batch:
                            pass
                        return
                    except Exception as exc:
                        if not tries_left:
                            log.warning("relay's last pass left rows in the outbox for the next relay: %s", exc)
                            return
                        await asyncio.sleep(0.2)
        except TimeoutError:
            log.warning("relay's last pass ran out of time; rows stay in the outbox for the next relay")

    async def publish_pending(self, *, stale_after_s: float | None = None) -> int:
        """Publish this process's rows, or (``stale_after_s``) anyone's rows older than that."""
        rows = await self._store.outbox_batch(self._batch, stale_after_s=stale_after_s)
        if not rows:
            return 0
        live_only = [is_live_only(row.subject) for row in rows]
        # In the batch's order (each publish queues its command as its task starts); the flush
        # starts last, so its PONG follows every live-only message of the batch.
        *results, flushed = await asyncio.gather(
            *(self._publish(row, live) for row, live in zip(rows, live_only)),
            self._flush() if any(live_only) else _nothing(),
            return_exceptions=True,
        )
        if isinstance(flushed, BaseException):
            results = [flushed if live else result for result, live in zip(results, live_only)]
        done = [row.seq for row, result in zip(rows, results) if not isinstance(result, BaseException)]
        if done:
            await self._store.outbox_done(done)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return len(rows)

    async def _publish(self, row: OutboxRow, live_only: bool) -> None:
        headers = {} if live_only else {MSG_ID_HEADER: row.msg_id}
        if row.traceparent is not None and tracing.enabled():
            # A span of the job's trace; the message carries its context, so the consumer's
            # span (the worker's run) is its child.
            context = tracing.context_from(row.traceparent, row.tracestate)
            attributes = {"messaging.system": "nats", "messaging.operation.type": "send",
                          "messaging.destination.name": row.subject, "messaging.message.id": row.msg_id}
            with tracing.span(f"publish {row.subject.split('.', 1)[0]}", context, kind=tracing.SpanKind.PRODUCER,
                              attributes=attributes):
                tracing.inject(headers)
                await self._send(row, headers, live_only)
            return
        if row.traceparent is not None:  # tracing off: the job's context as kept
            headers[tracing.TRACEPARENT] = row.traceparent
            if row.tracestate:
                headers[tracing.TRACESTATE] = row.tracestate
        await self._send(row, headers, live_only)

    async def _flush(self) -> None:
        await self._nc.flush(self._timeout_s)  # type: ignore[arg-type]  # a float works; nats-py's annotation says int

    async def _send(self, row: OutboxRow, headers: dict[str, str], live_only: bool) -> None:
        if live_only:
            await self._nc.publish(row.subject, row.payload, headers=headers or None)
        else:
            await self._js.publish(row.subject, row.payload, headers=headers, timeout=self._timeout_s)


async def _nothing() -> None:
    return None
