"""The status resource (SPEC §4)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

from schemas.problems import Problem

# The one spelling of the job states; every list of them is derived from these.
LiveState = Literal["queued", "running"]
TerminalState = Literal["succeeded", "failed", "cancelled"]
JobState = Literal[LiveState, TerminalState]
JOB_STATES: tuple[JobState, ...] = get_args(JobState)
LIVE_STATES: tuple[LiveState, ...] = get_args(LiveState)
TERMINAL_STATES: frozenset[str] = frozenset(get_args(TerminalState))

EventType = Literal[
    "job.queued",
    "job.running",
    "job.progress",
    "job.cancel_requested",
    "job.succeeded",
    "job.failed",
    "job.cancelled",
]
# A state change is announced as ``job.<state>``: a stream ends with one of these.
TERMINAL_EVENT_TYPES: frozenset[str] = frozenset(f"job.{state}" for state in TERMINAL_STATES)
assert TERMINAL_EVENT_TYPES <= set(get_args(EventType))


# Why a queued job waits (SPEC §13), on the status resource: its tenant runs its
# ``max_running`` already, or every worker slot of its kind is taken (its turn comes).
QueuedReason = Literal["tenant-max-running", "waiting-for-slot"]


class JobLinks(msgspec.Struct, kw_only=True):
    self: str
    events: str
    output: str | None = None  # the job's streamed output (SPEC §8); null only in history an older Herald kept
    result: str | None = None


class JobStatus(msgspec.Struct, kw_only=True):
    id: str
    kind: str
    state: JobState
    progress: int | None
    version: int
    attempt: int
    created_at: str
    updated_at: str
    expires_at: str | None
    cancel_requested: bool
    result: str | None
    error: Problem | None
    links: JobLinks
    # The job's W3C trace id (32 lowercase hex digits): find its spans in your tracing backend.
    trace_id: str | None = None
    # Queued jobs on the status resource and job lists only (null in the history: a stored
    # snapshot cannot know why a job will wait).
    queued_reason: Annotated[QueuedReason | None, msgspec.Meta(description=(
        "Why a queued job waits: its tenant runs its max_running already (tenant-max-running), "
        "or its turn for a worker slot comes (waiting-for-slot). null unless queued."))] = None


class JobList(msgspec.Struct, kw_only=True):
    items: list[JobStatus]
    next_cursor: str | None
