"""What a PostgreSQL job store remembers between its round trips, so that a transition can
skip the read that judges it: the server's clock as last read, and the job rows this process
last read or wrote.

Both are guesses that the write itself checks. A transition judged on a remembered row
compares-and-sets on that row's ``version`` and ``updated_at``, so a row another process
changed since makes the write miss, and the store reads and judges again (as it does when
two writers race today). Only a *permission* is taken from a remembered row: if the rules
refuse the change on it, or it would change nothing visible, the store reads the row before
it answers, so no caller is ever refused on a stale row.
"""

from __future__ import annotations

import time

from herald.jobs import JobRow

# A clock read older than this is read again: the server's clock may be stepped (NTP), and
# this machine's monotonic clock only stands in for the time elapsed since the last read.
CLOCK_MAX_AGE_S = 1.0
# Rows remembered: a worker's jobs in flight, a gateway's recent starts; the oldest go first.
ROWS_MAX = 4096


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


class RecentRows:
    """The last row this process saw of each live job, the most recent ``ROWS_MAX`` jobs."""

    def __init__(self, size: int = ROWS_MAX) -> None:
        self._size = size
        self._rows: dict[str, JobRow] = {}  # insertion order: the least recently seen first

    def saw(self, row: JobRow) -> None:
        self._rows.pop(row.id, None)
        if row.terminal:  # no change applies to it any more: nothing to judge on
            return
        self._rows[row.id] = row
        if len(self._rows) > self._size:
            del self._rows[next(iter(self._rows))]

    def offered(self, row: JobRow) -> None:
        """``row`` learnt from elsewhere (a work message): kept unless a later one of the job is."""
        known = self._rows.get(row.id)
        if known is None or (known.version, known.updated_at) < (row.version, row.updated_at):
            self.saw(row)

    def forget(self, job_id: str) -> None:
        self._rows.pop(job_id, None)

    def get(self, job_id: str) -> JobRow | None:
        return self._rows.get(job_id)
