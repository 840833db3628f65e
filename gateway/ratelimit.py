"""Per-tenant token bucket for job starts (SPEC §10): rate/s, burst twice that."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from gateway.problems import ProblemError


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class StartLimiter:
    def __init__(self, rate_per_s: float) -> None:
        self.rate = rate_per_s
        self.burst = max(1.0, 2 * rate_per_s)
        self._buckets: dict[str, _Bucket] = {}

    def take(self, tenant: str) -> None:
        """Spend one token or raise 429 with the seconds until one is back."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(tokens=self.burst, at=now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return
        wait = max(1, math.ceil((1 - bucket.tokens) / self.rate))
        raise ProblemError(
            429, "/problems/rate-limited", "Too many requests",
            f"job starts are limited to {self.rate:g}/s per tenant; retry after {wait} s",
            headers={"Retry-After": str(wait)},
        )
