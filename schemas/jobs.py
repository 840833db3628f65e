"""The status resource (SPEC §4)."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.problems import Problem

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

EventType = Literal[
    "job.queued",
    "job.running",
    "job.progress",
    "job.cancel_requested",
    "job.succeeded",
    "job.failed",
    "job.cancelled",
]


class JobLinks(msgspec.Struct, kw_only=True):
    self: str
    events: str
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


class JobList(msgspec.Struct, kw_only=True):
    items: list[JobStatus]
    next_cursor: str | None
