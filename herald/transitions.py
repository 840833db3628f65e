"""The rules of a job's life: which state may follow which, and what a change must match.

Policy as data: ``ALLOWED_NEXT`` is the state table; a ``Change`` names the states it may
start from and the attempt that writes it; ``refusal`` says why a change may not apply.
``Store.transition`` applies them inside its transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from herald.jobs import JobRow
from schemas import TERMINAL_STATES, JobState, Problem

# The refusal of a claim whose tenant is at its ``max_running``: the job stays queued.
TENANT_AT_CAP = "tenant-max-running"

# Which state may follow which. Terminal states have no entry: they never change.
ALLOWED_NEXT: Mapping[JobState, frozenset[JobState]] = {
    "queued": frozenset({"running", "cancelled", "failed"}),
    "running": frozenset({"running", "queued", "succeeded", "failed", "cancelled"}),
}


@dataclass(frozen=True, slots=True)
class Change:
    """One requested transition. ``expect`` lists the states it may start from."""

    expect: Collection[JobState]
    to: JobState | None = None  # None: the state stays
    attempt: int | None = None  # fencing: only the worker of this attempt may write
    progress: int | None = None
    cancel_requested: bool | None = None
    requeue: bool = False  # attempt + 1 and a new work message
    claim: bool = False  # a worker starts: attempt becomes at least 1
    # With ``claim``: refused (TENANT_AT_CAP) while the job's tenant already runs this many
    # jobs, counted in the store under a per-tenant lock (SPEC §13 max_running); 0: no cap.
    max_running: int = 0
    error: Problem | None = None
    result_path: str | None = None
    media_type: str | None = None
    # A success's JSON result kept in the row, in the same transaction (only for a store that
    # ``keeps_results``): no file, no second write, nothing a power cut can split.
    result_body: bytes | None = None
    stale_before: float | None = None  # only if the heartbeat is older than this
    # A test seam, not dead code: called with the row as read, after the rules above, so a
    # test can commit a competing write before the compare-and-set (test_store_postgres_jobs).
    extra_check: Callable[[JobRow], str | None] | None = field(default=None, compare=False)


def event_type(before: JobRow, after: JobRow) -> str | None:
    if after.state != before.state:
        return f"job.{after.state}"
    if after.cancel_requested != before.cancel_requested:
        return "job.cancel_requested"
    if after.progress != before.progress:
        return "job.progress"
    if after.attempt != before.attempt:
        return "job.running"
    return None


def refusal(job: JobRow | None, change: Change) -> str | None:
    """Why ``change`` may not apply to ``job`` (None: it may)."""
    if job is None:
        return "no such job"
    if job.state not in change.expect:
        return f"state is {job.state}, expected {'/'.join(sorted(change.expect))}"
    if change.to is not None and change.to not in ALLOWED_NEXT.get(job.state, frozenset()):
        return f"{job.state} -> {change.to} is not allowed"
    if change.attempt is not None and job.attempt != change.attempt:
        return f"attempt is {job.attempt}, writer has {change.attempt}"
    if change.stale_before is not None and (job.heartbeat_at or 0) >= change.stale_before:
        return "heartbeat is fresh"
    if change.extra_check is not None:
        return change.extra_check(job)
    return None


_error_encoder = msgspec.json.Encoder()


def changed_row(before: JobRow, change: Change, *, at: float, retention_s: float) -> tuple[JobRow, dict[str, Any]]:
    """The row after ``change`` at store time ``at``, and the columns that change (with the
    version, which always moves). One rule for every backend; ``refusal`` is checked first."""
    values: dict[str, Any] = {"updated_at": at}
    to = change.to or before.state
    values["state"] = to
    if change.claim:
        values["attempt"] = max(before.attempt, 1)
        values["heartbeat_at"] = at
    if change.requeue:
        values["attempt"] = before.attempt + 1
        values["heartbeat_at"] = None
        values["progress"] = None
    if change.progress is not None:
        values["progress"] = change.progress
    if change.cancel_requested is not None:
        values["cancel_requested"] = change.cancel_requested
    if change.error is not None:
        values["error"] = _error_encoder.encode(change.error)
    if change.result_path is not None:
        values["result_path"] = change.result_path
        values["media_type"] = change.media_type
    if change.result_body is not None:
        values["result_body"] = change.result_body
        values["media_type"] = change.media_type
    if to in TERMINAL_STATES:
        values["finished_at"] = at
        values["expires_at"] = at + retention_s
        if to == "succeeded":
            values["progress"] = 100
    return replace(before, **values, version=before.version + 1), values
