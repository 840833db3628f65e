"""Per-tenant limits: the job-start budget, and a cap on held connections (SPEC §10).

The start budget is a token bucket kept in the store and spent inside the accept
transaction, so all gateways of a deployment share one budget per tenant (SPEC §11).
Held connections are counted per gateway process: they are a process's own resource.
"""

from __future__ import annotations

import math
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from gateway.problems import Overloaded, RateLimited, TooManyStreams
from herald.storage.ports import StartBudget
from herald.tenants import LimitsSource


# How long a refused stream is told to wait: held streams end when clients go or jobs end,
# so a few seconds is a fair guess and keeps a reconnect loop from hammering the gateway.
STREAM_RETRY_AFTER_S = 5


MIN_RATE = 1 / 86400  # job starts per second: one a day


class TenantLimits:
    """Each tenant's limits come from ``limits`` (the tenant directory: its own, or the
    deployment's defaults), read at each start or opening, so a change made through /admin
    applies to the next request. SSE streams (a job's, the tenant's, the portal's notices),
    held long polls and held feed polls (``GET /events?wait=`` answered as JSON) are one
    count against the tenant's ``max_streams``."""

    def __init__(self, limits: LimitsSource, held_budget: int | None = None) -> None:
        """``held_budget``: how many held connections this process can take in all (its open
        files, less what it needs besides: ``held_budget``); None: no bound but each
        tenant's own."""
        self.limits = limits
        self.held_budget = held_budget
        self._held: Counter[str] = Counter()
        self._total = 0

    def start_budget(self, tenant: str) -> StartBudget | None:
        rate = self.limits.limits(tenant).rate_limit
        if rate <= 0:
            return None  # a rate of 0 turns the limit off
        # The burst is twice the rate (SPEC §1). A rate below one start a day counts as one a
        # day: the bucket's arithmetic would underflow (PostgreSQL refuses to) or wait forever.
        rate = max(rate, MIN_RATE)
        return StartBudget(rate=rate, burst=max(1.0, 2 * rate))

    def rate_limited(self, tenant: str, wait_s: float) -> RateLimited:
        wait = max(1, math.ceil(min(wait_s, 1 / MIN_RATE)))
        rate = self.limits.limits(tenant).rate_limit
        return RateLimited(f"job starts are limited to {rate:g}/s for this tenant; retry after {wait} s",
                           retry_after=wait)

    def held(self, tenant: str) -> int:
        return self._held[tenant] if tenant in self._held else 0

    def open_stream(self, tenant: str) -> None:
        """Count one held connection (SSE stream, long poll, held feed poll) or refuse it with 429."""
        cap = self.limits.limits(tenant).max_streams
        held = self.held(tenant)
        if held >= cap:
            raise TooManyStreams(
                f"this tenant already holds {cap} streams and long polls (max_streams) on this gateway;"
                " close some first", retry_after=STREAM_RETRY_AFTER_S)
        if self.held_budget is not None and self._total >= self.held_budget:
            # The process is out of room: a tenant holding its fair part of it or more waits,
            # one holding less still gets in (from the reserve left out of the budget), so a
            # tenant that filled the gateway first cannot keep every other tenant out.
            share = self.held_budget // (len(self._held) + (tenant not in self._held))
            if held >= share:
                raise TooManyStreams(
                    f"this gateway holds all the streams and long polls it can, and this tenant holds"
                    f" {held} of them, its share; close some first", retry_after=STREAM_RETRY_AFTER_S)
        self._held[tenant] += 1
        self._total += 1

    def close_stream(self, tenant: str) -> None:
        self._held[tenant] -= 1
        self._total -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant]

    def stream_slot(self, tenant: str) -> Callable[[], None]:
        """``open_stream``, and the one call that closes it (calling it again does nothing).
        A streamed response takes it and calls it when it ends, however it ends
        (``gateway.sse.EventStream``): a count closed only where its stream's body ran was
        never closed for a body that never started."""
        self.open_stream(tenant)
        open_ = True

        def close() -> None:
            nonlocal open_
            if open_:
                open_ = False
                self.close_stream(tenant)

        return close


# Open files a gateway keeps for everything but held connections: its listening socket, NATS,
# the store, logs, and the requests that are answered at once; and the room a tenant below its
# share is let into once the budget is spent.
HELD_RESERVE = 128


def held_budget() -> int | None:
    """The held connections this process can take in all: its open-files limit (raised to the
    hard one at start, ``launcher.open_files``) less ``HELD_RESERVE``; None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else max(1, soft - HELD_RESERVE)


class BacklogGuard:
    """Back-pressure: while a tenant's oldest queued job of a kind is older than the bound,
    that tenant's starts of that kind get 503 (SPEC §13). Judged per tenant, so one tenant
    filling a queue is refused while the others are not; per kind, so a kind no running
    worker serves does not hold back the kinds that are being served.

    Each (kind, tenant) age is read from the store (one index lookup) at most every
    ``refresh_s``: starts are the hot path. Ages of pairs not asked about lately are dropped.
    """

    def __init__(
        self, queued_age: Callable[[str, str], Awaitable[float]], max_age_s: float, refresh_s: float = 0.5,
        keep: int = 10_000,
    ) -> None:
        self._queued_age = queued_age
        self.max_age_s = max_age_s
        self._refresh_s = refresh_s
        self._keep = keep
        self._ages: dict[tuple[str, str], tuple[float, float]] = {}  # (kind, tenant) -> (age, read at)

    async def check(self, kind: str, tenant: str) -> None:
        if self.max_age_s <= 0:
            return
        now = time.monotonic()
        key = (kind, tenant)
        known = self._ages.get(key)
        if known is None or now - known[1] >= self._refresh_s:
            known = (await self._queued_age(kind, tenant), now)
            self._ages.pop(key, None)
            self._ages[key] = known
            if len(self._ages) > self._keep:
                del self._ages[next(iter(self._ages))]  # the least recently read
        age = known[0]
        if age > self.max_age_s:
            raise Overloaded(
                f"your oldest queued {kind} job has waited {age:.0f} s (limit {self.max_age_s:g} s); "
                "retry later instead of growing the backlog",
                retry_after=5,
            )
