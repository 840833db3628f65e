"""Retry and polling policy as data, and the pure functions that read it."""

from __future__ import annotations

import email.utils
import math
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter and a cap.

    ``delay(n)`` for the n-th consecutive retry (0-based) is ``min(cap, initial * factor**n)``
    scaled down by a random fraction of up to ``jitter``, so that many clients that failed
    together do not come back together.
    """

    initial: float = 0.5
    factor: float = 2.0
    cap: float = 30.0
    jitter: float = 0.5

    def delay(self, attempt: int, rng: random.Random) -> float:
        base = min(self.cap, self.initial * self.factor ** max(0, attempt))
        return base * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True, slots=True)
class Policy:
    """How hard the client tries.

    * ``retry``: between attempts of one request after a transport error, a 5xx, or a
      429/503 without ``Retry-After``; ``attempts`` bounds the tries of one call.
    * ``poll``: between polls of a running job when the server sends no ``Retry-After``.
    * ``max_retry_after``: a server's ``Retry-After`` longer than this is capped (a
      misconfigured proxy must not park a client for an hour).
    """

    retry: Backoff = Backoff()
    poll: Backoff = Backoff(initial=0.25, factor=1.5, cap=10.0, jitter=0.3)
    attempts: int = 6
    max_retry_after: float = 300.0
    stream_read_timeout: float = 45.0  # the server sends a keep-alive at least every 15 s


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP-date (RFC 9110 §10.2.3)."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
