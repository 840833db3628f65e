"""The outbox relay: publishes committed outbox rows to JetStream, deletes them after the PubAck.

Every process that commits transitions runs one, woken right after its own commits, and
publishes the rows its own process committed, so events reach NATS in milliseconds and
each row is published once (when every relay published the whole outbox, each event
reached NATS 1.6-1.8 times under load, and every gateway's hub received every copy).
A row left behind by a process that died is older than a sweep interval: every relay's
periodic pass publishes those, whoever committed them. Publishing the same row twice is
harmless: the message id makes JetStream drop the repeat, and every consumer is
idempotent by job id and version.

Each message carries its job's W3C trace context as ``traceparent``/``tracestate``
headers (``herald.tracing``): with tracing on, the context of its publish span.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.js import JetStreamContext

from herald import tracing
from herald.constants import MSG_ID_HEADER
from herald.storage.ports import JobStore, OutboxRow

log = logging.getLogger("herald.relay")


class Relay:
    def __init__(self, store: JobStore, js: JetStreamContext, *, sweep_interval_s: float, batch: int = 256) -> None:
        self._store = store
        self._js = js
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

    async def publish_pending(self, *, stale_after_s: float | None = None) -> int:
        """Publish this process's rows, or (``stale_after_s``) anyone's rows older than that."""
        rows = await self._store.outbox_batch(self._batch, stale_after_s=stale_after_s)
        if not rows:
            return 0
        results = await asyncio.gather(*(self._publish(row) for row in rows), return_exceptions=True)
        done = [row.seq for row, result in zip(rows, results) if not isinstance(result, BaseException)]
        if done:
            await self._store.outbox_done(done)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return len(rows)

    async def _publish(self, row: OutboxRow) -> None:
        headers = {MSG_ID_HEADER: row.msg_id}
        if row.traceparent is not None and tracing.enabled():
            # A span of the job's trace; the message carries its context, so the consumer's
            # span (the worker's run) is its child.
            context = tracing.context_from(row.traceparent, row.tracestate)
            attributes = {"messaging.system": "nats", "messaging.operation.type": "send",
                          "messaging.destination.name": row.subject, "messaging.message.id": row.msg_id}
            with tracing.span(f"publish {row.subject.split('.', 1)[0]}", context, kind=tracing.SpanKind.PRODUCER,
                              attributes=attributes):
                tracing.inject(headers)
                await self._js.publish(row.subject, row.payload, headers=headers, timeout=5.0)
            return
        if row.traceparent is not None:  # tracing off: the job's context as kept
            headers[tracing.TRACEPARENT] = row.traceparent
            if row.tracestate:
                headers[tracing.TRACESTATE] = row.tracestate
        await self._js.publish(row.subject, row.payload, headers=headers, timeout=5.0)
