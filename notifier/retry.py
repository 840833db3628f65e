"""What happens after an attempt: the retry policy as data plus one small pure function.

After Svix and Standard Webhooks: the n-th failure waits ``schedule[n-1]`` seconds
(±20 % jitter) and the delivery fails once the schedule is used up. A timeout or a
``429`` waits at least ``min_backoff_s`` (``Settings.webhook_min_backoff_s``, which tests
shrink), and ``Retry-After`` on ``429``/``503`` is honoured but kept within
[scheduled delay, 2 × scheduled delay], the jitter having been applied first. A ``410``
means "never again": the delivery fails and its endpoint is disabled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from herald.deliveries import Outcome, Plan

RETRY_AFTER_STATUSES = frozenset({429, 503})
BACKOFF_FLOOR_STATUSES = frozenset({429})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    schedule: tuple[float, ...]  # both from Settings, which holds their defaults
    min_backoff_s: float
    jitter: float = 0.2

    def plan(self, outcome: Outcome, attempts_made: int, rng: random.Random) -> Plan:
        """``attempts_made`` counts the attempt that produced ``outcome``."""
        if outcome.ok:
            return Plan("delivered")
        if outcome.status_code == 410:
            return Plan("failed", disable_endpoint=True)
        index = attempts_made - 1
        if index >= len(self.schedule):
            return Plan("failed")
        delay = self.schedule[index] * rng.uniform(1 - self.jitter, 1 + self.jitter)
        if outcome.timed_out or outcome.status_code in BACKOFF_FLOOR_STATUSES:
            delay = max(delay, self.min_backoff_s)
        if outcome.status_code in RETRY_AFTER_STATUSES and outcome.retry_after_s is not None:
            delay = min(max(outcome.retry_after_s, delay), 2 * delay)
        return Plan("retry", delay_s=delay)
