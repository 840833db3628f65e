"""Wakes the streams of ``GET /webhooks/events`` when a tenant's delivery log changed.

Delivery rows and attempts are written by notifiers (and by the API), not by the job
store's transitions, so the hub's job events cannot tell the portal when to look again.
Notifiers publish a *notice* (``herald.deliveries.Notice``, core NATS) after each commit
that changes deliveries; every gateway subscribes and marks the tenant's watchers. A
notice is a hint, never data: the page re-reads the API, which reads the store. A lost
notice costs freshness, never correctness, and after a NATS reconnect every watcher is
told to re-read everything.

A watcher keeps a *set* of changed endpoints, not a queue: a burst of notices for one
endpoint is one re-read, and a watcher can never overflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from herald.deliveries import NOTICE_SUBJECTS, Notice, notice_subject

log = logging.getLogger("herald.hub")
_decoder = msgspec.json.Decoder(Notice)
_encoder = msgspec.json.Encoder()

EVERYTHING = None  # marked when the watcher must re-read every endpoint


class Watcher:
    __slots__ = ("tenant", "changed", "wake")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.changed: set[str | None] = set()
        self.wake = asyncio.Event()

    def mark(self, endpoint_id: str | None) -> None:
        self.changed.add(endpoint_id)
        self.wake.set()

    def take(self) -> list[str | None]:
        """What changed since the last call: ``[None]`` if everything may have."""
        changed, self.changed = self.changed, set()
        self.wake.clear()
        if EVERYTHING in changed:
            return [EVERYTHING]
        return [c for c in sorted(c for c in changed if c is not None)]


class DeliveryWatch:
    def __init__(self) -> None:
        self._watchers: dict[str, set[Watcher]] = defaultdict(set)
        self._subscription: Subscription | None = None
        self._nc: NATS | None = None

    async def attach(self, nc: NATS) -> None:
        self._nc = nc
        self._subscription = await nc.subscribe(NOTICE_SUBJECTS, cb=self._on_message)

    async def detach(self) -> None:
        subscription, self._subscription, self._nc = self._subscription, None, None
        if subscription is not None:
            with contextlib.suppress(Exception):  # the connection may be closed already
                await subscription.unsubscribe()

    async def _on_message(self, message: Msg) -> None:
        try:
            notice = _decoder.decode(message.data)
        except msgspec.DecodeError:
            log.warning("undecodable delivery notice", extra={"subject": message.subject})
            return
        self.notify(notice.tenant, notice.endpoint_id)

    def notify(self, tenant: str, endpoint_id: str | None) -> None:
        for watcher in tuple(self._watchers.get(tenant, ())):
            watcher.mark(endpoint_id)

    async def announce(self, tenant: str, endpoint_id: str | None) -> None:
        """This process changed the tenant's deliveries: tell every gateway (itself included).
        Without NATS only this gateway's watchers hear of it."""
        nc = self._nc
        if nc is not None and nc.is_connected:
            try:
                await nc.publish(notice_subject(tenant), _encoder.encode(Notice(tenant=tenant, endpoint_id=endpoint_id)))
                return
            except Exception as exc:  # a reconnect under way: the local watchers at least
                log.debug("delivery notice not published: %s", exc)
        self.notify(tenant, endpoint_id)

    def resync(self) -> None:
        """After a NATS reconnect notices may have been missed: every watcher re-reads all."""
        for group in self._watchers.values():
            for watcher in group:
                watcher.mark(EVERYTHING)

    def watch(self, tenant: str) -> Watcher:
        watcher = Watcher(tenant)
        self._watchers[tenant].add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        group = self._watchers.get(watcher.tenant)
        if group is not None:
            group.discard(watcher)
            if not group:
                del self._watchers[watcher.tenant]
