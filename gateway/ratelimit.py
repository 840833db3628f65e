"""Per-tenant limits: the job-start budget, and a cap on held connections (SPEC §10, §13).

The start budget is a token bucket kept in the store and spent inside the accept
transaction, so all gateways of a deployment share one budget per tenant (SPEC §11).
Held connections are counted per gateway process: they are a process's own resource.
SSE streams (a job's, the tenant's, the portal's notices), held long polls and held feed
polls (``GET /events?wait=`` answered as JSON) are one count against the tenant's
``max_streams``, read from the ``LimitsSource`` at each opening (so a change through the
admin API holds for the next one).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

from gateway.problems import Overloaded, RateLimited, TooManyStreams
from herald.storage.ports import StartBudget
from herald.tenants import LimitsSource

# How long a refused stream is told to wait: held streams end when clients go or jobs end,
# so a few seconds is a fair guess and keeps a reconnect loop from hammering the gateway.
STREAM_RETRY_AFTER_S = 5


class TenantLimits:
    def __init__(self, starts_per_s: float, limits: LimitsSource) -> None:
        self.rate = starts_per_s
        # HERALD_RATE_LIMIT=0 turns the limit off; the burst is twice the rate (SPEC §1).
        self.start_budget = StartBudget(rate=starts_per_s, burst=max(1.0, 2 * starts_per_s)) if starts_per_s > 0 else None
        self.limits = limits
        self._held: Counter[str] = Counter()

    def held(self, tenant: str) -> int:
        return self._held[tenant] if tenant in self._held else 0

    def rate_limited(self, wait_s: float) -> RateLimited:
        wait = max(1, math.ceil(wait_s))
        return RateLimited(f"job starts are limited to {self.rate:g}/s per tenant; retry after {wait} s", retry_after=wait)

    def open_stream(self, tenant: str) -> None:
        """Count one held connection (SSE stream, long poll, held feed poll) or refuse it with 429."""
        cap = self.limits.limits(tenant).max_streams
        if self.held(tenant) >= cap:
            raise TooManyStreams(
                f"this tenant already holds {cap} streams and long polls (max_streams) on this gateway;"
                " close some first", retry_after=STREAM_RETRY_AFTER_S)
        self._held[tenant] += 1

    def close_stream(self, tenant: str) -> None:
        self._held[tenant] -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant]


class BacklogGuard:
    """Back-pressure: while the oldest queued job of a kind is older than the bound, starts
    of that kind get 503. Per kind: a kind no running worker serves (its jobs wait in
    JetStream for one) does not hold back the kinds that are being served.

    The ages are read from the store at most every ``refresh_s`` (a partial index makes the
    read cheap, but starts are the hot path).
    """

    def __init__(
        self, queued_ages: Callable[[], Awaitable[Mapping[str, float]]], max_age_s: float, refresh_s: float = 0.5
    ) -> None:
        self._queued_ages = queued_ages
        self.max_age_s = max_age_s
        self._refresh_s = refresh_s
        self._ages: Mapping[str, float] = {}
        self._read_at = -math.inf

    async def check(self, kind: str) -> None:
        if self.max_age_s <= 0:
            return
        now = time.monotonic()
        if now - self._read_at >= self._refresh_s:
            self._ages, self._read_at = await self._queued_ages(), now
        age = self._ages.get(kind, 0.0)
        if age > self.max_age_s:
            raise Overloaded(
                f"the oldest queued {kind} job has waited {age:.0f} s (limit {self.max_age_s:g} s); "
                "retry later instead of growing the backlog",
                retry_after=5,
            )
