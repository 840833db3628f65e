"""The outbox relay: publishes committed outbox rows to JetStream, deletes them after the PubAck.

Every process that commits transitions runs one, woken right after its own commits, so
events reach NATS in milliseconds. A row left behind by a crash is picked up by any
relay's periodic pass. Publishing the same row twice is harmless: the message id makes
JetStream drop the repeat, and every consumer is idempotent by job id and version.

Each message carries its job's W3C trace context as ``traceparent``/``tracestate``
headers (``herald.tracing``): with tracing on, the context of its publish span.
"""

from __future__ import annotations

import asyncio
import logging

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
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._sweep_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                while await self.publish_pending() >= self._batch:
                    pass
                backoff = 0.1
            except Exception as exc:  # NATS unreachable, timeouts: rows stay in the outbox
                log.warning("relay publish failed, will retry: %s", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self._wake.set()

    async def publish_pending(self) -> int:
        rows = await self._store.outbox_batch(self._batch)
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
