"""A durable pull consumer read as a stream: each message as soon as it arrives.

nats-py's ``PullSubscription.fetch(batch, timeout)`` returns at once only while its opening
``no_wait`` request is served. When another reader of the same consumer has a request
waiting (a second notifier), the server answers that probe ``408 Requests Pending``; fetch
then sends a lingering request for the whole batch and, once the first message has come,
waits out the rest of its timeout for the batch to fill. Every event that came meanwhile
waited with it: commit -> webhook p99 near the fetch timeout (1 s) in the cluster shape,
where two notifiers share the consumer (bench/RESULTS.md).

Here one lingering request is out at a time, for up to ``batch`` messages, and the server
pushes each message as it comes. ``next_batch`` returns what has arrived, at least one
message, without waiting for more. A request ends when all its messages have come or
with a status (``408`` when it expires); the next is sent when more are wanted. Each
request answers on its own reply subject, so a late status of an abandoned request
(lost with a connection, or a consumer leader that moved) is told apart from the current
one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

log = logging.getLogger("herald.pullstream")

HEARTBEAT_STATUS = "100"
# A request that neither ended nor brought anything this long after it expired was lost.
LOST_AFTER_S = 1.0
# A request the server ended this soon delivered nothing worth asking again at once for
# (no JetStream, a deleted consumer): the next waits this long, so a fault is not a busy loop.
QUICK_END_S = 0.1
RETRY_AFTER_S = 0.5


class PullStream:
    """Messages of ``stream``'s durable pull ``consumer`` as they come, for one reader.

    Readers may share the consumer (every notifier binds the same one); the server hands
    each message to one of their waiting requests."""

    def __init__(self, nc: NATS, stream: str, consumer: str, *, batch: int, expires_s: float) -> None:
        self._nc = nc
        self._api_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._batch = batch
        self._expires_s = expires_s
        self._inbox = nc.new_inbox()
        self._arrivals: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub: object | None = None
        self._serial = 0
        self._reply = ""  # the current request's reply subject; "" while none is out
        self._owed = 0  # messages the current request may still bring
        self._sent_at = 0.0
        self._not_before = 0.0  # after a request that ended at once
        self._closed = False

    async def next_batch(self, timeout: float) -> list[Msg]:
        """What has arrived: at least one message and at most ``batch``; [] after ``timeout``
        or once closed."""
        if self._closed:
            return []
        if self._sub is None:
            self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._arrived)
        deadline = time.monotonic() + timeout
        messages: list[Msg] = []
        while True:
            while len(messages) < self._batch and not self._arrivals.empty():
                self._take(self._arrivals.get_nowait(), messages)
            now = time.monotonic()
            if messages or now >= deadline or self._closed:
                return messages
            await self._keep_request_out(now)
            # Wake up to ask again: after a refusal's pause, or for a request whose end never
            # came (lost with a connection, or with a consumer leader that moved).
            wake_at = self._lost_at() if self._reply else self._not_before
            try:
                arrived = await asyncio.wait_for(self._arrivals.get(), max(0.001, min(deadline, wake_at) - now))
            except TimeoutError:
                if self._reply and time.monotonic() >= self._lost_at():
                    self._reply = ""
                continue
            self._take(arrived, messages)

    async def close(self) -> None:
        """Stop listening; hand back what came and was not taken (another reader gets it at once)."""
        self._closed = True
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()  # type: ignore[attr-defined]
            self._sub = None
        while not self._arrivals.empty():
            msg = self._arrivals.get_nowait()
            if not JetStreamContext.is_status_msg(msg) and msg.reply:
                with contextlib.suppress(Exception):
                    await msg.nak()

    def _lost_at(self) -> float:
        """When the current request, neither ended nor answered, counts as lost."""
        return self._sent_at + self._expires_s + LOST_AFTER_S

    async def _arrived(self, msg: Msg) -> None:
        self._arrivals.put_nowait(msg)

    async def _keep_request_out(self, now: float) -> None:
        if self._reply or now < self._not_before:
            return
        self._serial += 1
        reply = f"{self._inbox}.{self._serial}"
        request = {"batch": self._batch, "expires": int(self._expires_s * 1e9)}
        await self._nc.publish(self._api_subject, json.dumps(request).encode(), reply=reply)
        self._reply, self._owed, self._sent_at = reply, self._batch, now

    def _take(self, msg: Msg, messages: list[Msg]) -> None:
        status = JetStreamContext.is_status_msg(msg)
        if not status:
            # A message keeps its stream subject, so which request brought it is unknown: the
            # current one is charged, and at worst asked again for a little early.
            messages.append(msg)
            self._owed -= 1
            if self._owed <= 0:
                self._reply = ""  # all came: the request is over
            return
        # A status comes on its request's reply subject: an abandoned request's is ignored.
        if status == HEARTBEAT_STATUS or not self._reply or msg.subject != self._reply:
            return
        self._reply = ""
        if time.monotonic() - self._sent_at < QUICK_END_S:  # refused, not expired
            log.warning("pull request refused: %s %s", status, msg.header or {})
            self._not_before = time.monotonic() + RETRY_AFTER_S
