"""What every job-store backend does around its own transactions, written once.

Listeners hear of each event this process committed (the relay's wake-up, metrics, the
transition log line). A transition is timed for tracing; a refused one is logged with its
job id and counted, never silent, since it is normal under retries and races.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from herald import tracing
from herald.jobs import JobRow, Transition, TransitionRejected
from herald.metrics import metrics
from herald.storage.ports import CommitListener
from herald.transitions import Change
from schemas import JobEvent

_log = logging.getLogger("herald.store")


class CommitListeners:
    """The ``on_commit`` half of a ``JobStore``; backends call ``_committed`` after each commit."""

    def __init__(self) -> None:
        self._listeners: list[CommitListener] = []

    def on_commit(self, callback: CommitListener) -> None:
        """Called on the loop after every committed event: wakes the relay, counts, logs."""
        self._listeners.append(callback)

    def _committed(self, job: JobRow, event: JobEvent) -> None:
        for callback in self._listeners:
            callback(job, event)

    async def _observed_transition(
        self, job_id: str, change: Change, apply: Callable[[], Awaitable[Transition]]
    ) -> Transition:
        """Run a backend's ``apply`` (its transaction) with the bookkeeping every backend owes."""
        started = tracing.now_ns()
        try:
            result = await apply()
        except TransitionRejected as exc:
            _log.info("transition rejected", extra={"job_id": job_id, "reason": exc.reason, "to": change.to})
            metrics().transitions_rejected.inc()
            tracing.record_transition(started, exc.current, change, None, exc.reason)
            raise
        tracing.record_transition(started, result.after, change, result.event, None)
        if result.event is not None:
            self._committed(result.after, result.event)
        return result
