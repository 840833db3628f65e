"""Notices to the gateways: "this tenant's delivery log changed" (``herald.deliveries.Notice``).

Published on core NATS after the notifier committed new deliveries (fan-out) or an
attempt (``finish``), so a portal watching the tenant (``GET /webhooks/events``) re-reads
at once instead of polling. Hints only: nothing depends on their arrival. Notices are
coalesced for ``COALESCE_S`` (one per tenant and endpoint), so a busy notifier sends a few
small messages per tenant and tick, not one per attempt.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.aio.client import Client as NATS

from herald.deliveries import Notice, notice_subject

log = logging.getLogger("herald.notifier")

COALESCE_S = 0.05
_encoder = msgspec.json.Encoder()


class Notices:
    def __init__(self) -> None:
        self._pending: set[tuple[str, str | None]] = set()
        self._wake = asyncio.Event()
        self._nc: NATS | None = None

    def attach(self, nc: NATS) -> None:
        self._nc = nc

    def note(self, tenant: str, endpoint_id: str | None) -> None:
        """The tenant's deliveries to ``endpoint_id`` (None: to any endpoint) changed."""
        self._pending.add((tenant, endpoint_id))
        self._wake.set()

    async def run(self) -> None:
        """Publish what was noted, coalesced, until cancelled."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(COALESCE_S)
            self._wake.clear()
            pending, self._pending = self._pending, set()
            nc = self._nc
            if nc is None or not nc.is_connected:
                continue  # hints: a portal re-reads on its next notice or reconnect
            for tenant, endpoint_id in pending:
                if endpoint_id is not None and (tenant, None) in pending:
                    continue  # "everything" already covers it
                try:
                    await nc.publish(notice_subject(tenant),
                                     _encoder.encode(Notice(tenant=tenant, endpoint_id=endpoint_id)))
                except Exception as exc:  # reconnecting: hints may be lost
                    log.debug("delivery notice not published: %s", exc)
                    break
