"""What a PostgreSQL job store remembers of its server between round trips, so that a
write can skip reading the server's clock first: the clock as last read. (The job rows it
remembers are ``herald.storage.recent_rows``, which the SQLite store shares.)

A guess: a transition stamped with it compares-and-sets on its row as read or remembered,
and a job's times never step back (``max`` with the row's ``updated_at``).
"""

from __future__ import annotations

import time


# A clock read older than this is read again: the server's clock may be stepped (NTP), and
# this machine's monotonic clock only stands in for the time elapsed since the last read.
CLOCK_MAX_AGE_S = 1.0


class ServerClock:
    """The server's clock (``clock_timestamp()``) as read at most ``CLOCK_MAX_AGE_S`` ago,
    plus the time elapsed here since. A read is placed halfway through its round trip, so
    the guess is off by at most half of it: less than a statement queued for a group commit
    waits today between the clock read that stamps it and its execution."""

    def __init__(self, max_age_s: float = CLOCK_MAX_AGE_S) -> None:
        self._max_age_s = max_age_s
        self._server = 0.0
        self._local: float | None = None

    def read(self, server_now: float, sent: float) -> None:
        """The server answered ``server_now`` to a request sent at ``sent`` (``time.monotonic()``)."""
        self._server = server_now
        self._local = (sent + time.monotonic()) / 2

    def now(self) -> float | None:
        """The server's time now, or None if there is no recent enough read to go by."""
        if self._local is None:
            return None
        elapsed = time.monotonic() - self._local
        if elapsed > self._max_age_s:
            return None
        return self._server + max(0.0, elapsed)
