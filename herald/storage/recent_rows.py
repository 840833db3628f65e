"""The job rows a store process last read or wrote, so that a transition can be judged
without reading its job first (both stores: ``herald.storage.postgres.jobs`` to save a
round trip, ``herald.storage.sqlite.jobs`` to keep the judging out of the write lock).

A remembered row is a guess the write itself checks: a transition judged on it
compares-and-sets on its ``version`` and ``updated_at``, so a row another process changed
since makes the write miss, and the store reads and judges again (as when two writers race).
Only a *permission* is taken from a remembered row: if the rules refuse the change on it,
or it would change nothing visible, the store reads the row before it answers, so no caller
is ever refused on a stale row.
"""

from __future__ import annotations

from herald.jobs import JobRow

# Rows remembered: a worker's jobs in flight, a gateway's recent starts; the oldest go first.
ROWS_MAX = 4096


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
