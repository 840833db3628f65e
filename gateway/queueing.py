"""Why a queued job waits (SPEC §13): the ``queued_reason`` of the status resource.

Only a tenant with a ``max_running`` cap costs a read (its running jobs, one index lookup,
cached per tenant for ``refresh_s``); every other queued job waits for a slot.
"""

from __future__ import annotations

import time

from herald.jobs import JobRow
from herald.storage.ports import JobStore
from herald.tenants import LimitsSource
from schemas.jobs import QueuedReason


class QueueReasons:
    def __init__(self, store: JobStore, limits: LimitsSource, refresh_s: float = 0.5, keep: int = 10_000) -> None:
        self._store = store
        self.limits = limits
        self._refresh_s = refresh_s
        self._keep = keep
        self._running: dict[str, tuple[int, float]] = {}  # tenant -> (running jobs, read at)

    async def reason(self, job: JobRow) -> QueuedReason | None:
        if job.state != "queued":
            return None
        cap = self.limits.limits(job.tenant).max_running
        if cap <= 0:
            return "waiting-for-slot"
        now = time.monotonic()
        known = self._running.get(job.tenant)
        if known is None or now - known[1] >= self._refresh_s:
            count = (await self._store.running_counts([job.tenant])).get(job.tenant, 0)
            known = self._running[job.tenant] = (count, now)
            if len(self._running) > self._keep:
                del self._running[next(iter(self._running))]
        return "tenant-max-running" if known[0] >= cap else "waiting-for-slot"
