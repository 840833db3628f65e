"""The sweeper: every job ends. Safe to run in many processes at once (transitions are conditional).

* running jobs whose heartbeat is older than HERALD_HEARTBEAT_TIMEOUT_S are re-queued
  (attempt + 1) or, after the last attempt (HERALD_MAX_ATTEMPTS, or the kind's own
  ``max_attempts``), failed with /problems/worker-lost; one whose cancel was asked for is
  cancelled instead (SPEC §5: the client called the work off, and no worker does it now);
  not while the store has been back for less than a heartbeat timeout after the sweeper
  found it unreachable (``Outage``): no worker could write a heartbeat meanwhile;
* live jobs past their deadline fail with /problems/deadline-exceeded;
* jobs past ``expires_at`` are deleted with their result, streamed output, key and history
  (tombstone left).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from herald.jobs import JobRow, StoreUnavailable, TransitionRejected
from herald.kinds import get_kind
from herald.settings import Settings
from herald.storage.ports import JobStore, ResultStore
from herald.transitions import Change
from schemas.jobs import LIVE_STATES
from schemas.problems import DEADLINE_EXCEEDED, WORKER_LOST

log = logging.getLogger("herald.sweeper")


@dataclass
class Outage:
    """What the sweeper saw of the store being unreachable. A heartbeat a worker could not
    write while it was is no sign of a lost worker: a store restart or failover longer than
    the heartbeat timeout re-queued every running job on the first pass after it, just
    before each job's live worker retried its heartbeat (or recorded the end it had reached
    meanwhile), and the whole work was done again (its output emitted twice). So heartbeats
    are judged again only once the store has been back for a heartbeat timeout, by its clock."""

    ongoing: bool = False
    ended_at: float | None = None  # the store's clock at the first pass that reached it again

    def stale_before(self, at: float, settings: Settings) -> float:
        """Heartbeats older than this are silent; 0 (none is) within the grace after an outage."""
        if self.ongoing:
            self.ongoing, self.ended_at = False, at
        stale_before = at - settings.heartbeat_timeout_s
        return 0.0 if self.ended_at is not None and self.ended_at > stale_before else stale_before


def _decide(job: JobRow, settings: Settings, at: float, stale_before: float) -> Change | None:
    if job.deadline_at < at:
        return Change(
            expect=LIVE_STATES, to="failed", attempt=job.attempt,
            error=DEADLINE_EXCEEDED.problem(
                f"the job did not finish within its deadline of {job.deadline_at - job.created_at:g} s"),
        )
    if job.state != "running" or (job.heartbeat_at or 0) >= stale_before:
        return None
    if job.cancel_requested:
        # Its worker is gone before it saw the cancel: no work is left to stop, and that is the
        # end the client asked for. Re-queued, the job was started again from the beginning,
        # and a handler that never checks ran the work the client had called off to success.
        return Change(expect={"running"}, to="cancelled", attempt=job.attempt, stale_before=stale_before)
    kind = get_kind(job.kind)
    attempts = kind.attempts(settings.max_attempts) if kind is not None else settings.max_attempts
    if job.attempt >= attempts:
        # Past the allowance: workers stopping gracefully hand their jobs back, and each hand-back
        # is a start too (attempt + 1), but only a lost worker fails a job.
        of = (f"of {attempts}" if job.attempt == attempts
              else f"(past the {attempts} allowed: starts handed back at a worker's shutdown count too)")
        return Change(
            expect={"running"}, to="failed", attempt=job.attempt, stale_before=stale_before,
            error=WORKER_LOST.problem(f"the worker stopped heartbeating on attempt {job.attempt} {of}"),
        )
    return Change(expect={"running"}, to="queued", attempt=job.attempt, requeue=True, stale_before=stale_before)


# Removes a job's streamed output chunks (tenant, job id); herald.output.purge on JetStream.
OutputPurge = Callable[[str, str], Awaitable[None]]


async def sweep_once(store: JobStore, results: ResultStore, settings: Settings,
                     purge_output: OutputPurge | None = None, outage: Outage | None = None) -> None:
    at = await store.clock()  # heartbeats and deadlines were written by the store's clock: judge by it
    stale_before = (outage or Outage()).stale_before(at, settings)
    for job in await store.live_jobs(stale_before=stale_before, deadline_before=at):
        change = _decide(job, settings, at, stale_before)
        if change is None:
            continue
        try:
            done = await store.transition(job.id, change)
        except TransitionRejected as exc:
            log.info("sweep skipped", extra={"job_id": job.id, "reason": exc.reason})
            continue
        log.warning("job swept", extra={"job_id": job.id, "state": done.after.state, "attempt": done.after.attempt})
    cleared: list[JobRow] = []
    for job in await store.expired(at):
        # The result and the output go first: once the status answers 410, nothing of the
        # job is left. A job whose result or output cannot be removed now (a results volume
        # gone read-only, NATS away) keeps its row for the next pass to retry; the others
        # go on: one such job stopping the whole pass held every tenant's retention back.
        try:
            await results.delete_job(job.id)
            if purge_output is not None:
                await purge_output(job.tenant, job.id)
        except Exception as exc:
            log.warning("expired job kept: its result or output could not be removed yet",
                        extra={"job_id": job.id, "error": str(exc)})
            continue
        cleared.append(job)
        log.info("job expired", extra={"job_id": job.id})
    await store.forget(cleared, at)


async def run_sweeper(store: JobStore, results: ResultStore, settings: Settings,
                      purge_output: OutputPurge | None = None) -> None:
    outage = Outage()
    while True:
        try:
            await sweep_once(store, results, settings, purge_output, outage)
        except StoreUnavailable as exc:
            outage.ongoing = True
            log.warning("sweep skipped: the store is unreachable", extra={"error": str(exc)})
        except Exception:
            log.exception("sweep failed; next pass will retry")
        await asyncio.sleep(settings.sweep_interval_s)
