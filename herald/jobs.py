"""What the store hands out: job rows, the results of accepting and transitioning, its errors."""

from __future__ import annotations

import functools

from dataclasses import dataclass, fields
from typing import Any, Protocol

import msgspec

from herald.timefmt import rfc3339
from schemas import JobEvent, JobLinks, JobState, JobStatus, Problem, TERMINAL_STATES

_problem_decoder = msgspec.json.Decoder(Problem)


class ColumnAccess(Protocol):
    """A row as any backend hands it out (``sqlite3.Row``, ``asyncpg.Record``): columns by name."""

    def __getitem__(self, key: str, /) -> Any: ...


@dataclass(frozen=True, slots=True)
class JobRow:
    id: str
    tenant: str
    kind: str
    collection: str
    state: JobState
    params: bytes
    progress: int | None
    version: int
    attempt: int
    cancel_requested: bool
    created_at: float
    updated_at: float
    heartbeat_at: float | None
    deadline_at: float
    finished_at: float | None
    expires_at: float | None
    result_path: str | None
    media_type: str | None
    error: bytes | None
    callback_url: str | None
    # The job's W3C trace context (herald.tracing): the accept span's, kept for every later span.
    traceparent: str | None = None
    tracestate: str | None = None
    # A small JSON result kept in the row itself (stores with ``keeps_results``), instead of
    # a file or an object named by ``result_path``.
    result_body: bytes | None = None

    @classmethod
    def from_mapping(cls, row: ColumnAccess) -> JobRow:
        """From any backend's row (sqlite3.Row, asyncpg.Record): columns named as the fields."""
        values = {name: row[name] for name in _job_columns()}
        values["cancel_requested"] = bool(values["cancel_requested"])
        for name in ("params", "error"):
            if values[name] is not None:
                values[name] = bytes(values[name])
        try:
            body = row["result_body"]
        except (KeyError, IndexError):  # a store that keeps no result in the row
            body = None
        if body is not None:
            values["result_body"] = bytes(body)
        return cls(**values)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def trace_id(self) -> str | None:
        """The job's trace id (32 hex digits), from its ``traceparent``."""
        return self.traceparent[3:35] if self.traceparent else None

    @property
    def result_url(self) -> str:
        return f"{self.collection}/{self.id}"

    def status(self) -> JobStatus:
        """The status object with unsigned links, exactly as stored in the job's history."""
        result = self.result_url if self.state == "succeeded" else None
        return JobStatus(
            id=self.id,
            kind=self.kind,
            state=self.state,
            progress=self.progress,
            version=self.version,
            attempt=self.attempt,
            created_at=rfc3339(self.created_at) or "",
            updated_at=rfc3339(self.updated_at) or "",
            expires_at=rfc3339(self.expires_at),
            cancel_requested=self.cancel_requested,
            result=result,
            error=_problem_decoder.decode(self.error) if self.error else None,
            links=JobLinks(self=f"/jobs/{self.id}", events=f"/jobs/{self.id}/events", output=f"/jobs/{self.id}/output",
                           result=result),
            trace_id=self.trace_id,
        )


@dataclass(frozen=True, slots=True)
class NewJob:
    id: str
    tenant: str
    kind: str
    collection: str
    params: bytes
    deadline_s: float
    callback_url: str | None = None
    traceparent: str | None = None  # the accept span's context (herald.tracing.job_trace)
    tracestate: str | None = None

    def queued_row(self, ts: float) -> JobRow:
        """The row an accept at ``ts`` writes (built before the write, to encode its first event)."""
        return JobRow(
            id=self.id, tenant=self.tenant, kind=self.kind, collection=self.collection, state="queued",
            params=self.params, progress=None, version=1, attempt=0, cancel_requested=False,
            created_at=ts, updated_at=ts, heartbeat_at=None, deadline_at=ts + self.deadline_s,
            finished_at=None, expires_at=None, result_path=None, media_type=None, error=None,
            callback_url=self.callback_url, traceparent=self.traceparent, tracestate=self.tracestate,
        )


@dataclass(frozen=True, slots=True)
class IdempotencyClaim:
    key: str
    fingerprint: str
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Accepted:
    job: JobRow
    replayed: bool
    event: JobEvent | None = None


class StoreError(Exception):
    """Base of the store's own errors."""


class IdempotencyMismatch(StoreError):
    def __init__(self, key: str) -> None:
        super().__init__(f"Idempotency-Key {key!r} was used with a different request")
        self.key = key


class StoreUnavailable(StoreError):
    """The store cannot be reached now (starting, network, failover); retry later."""


class StoreUnwritable(StoreUnavailable):
    """The store's disk cannot take a write now (full, read-only): its message says which,
    in words of our own, safe to show."""


class RateLimited(StoreError):
    """The tenant's start budget is spent; a token is back after ``wait_s``."""

    def __init__(self, tenant: str, wait_s: float) -> None:
        super().__init__(f"tenant {tenant!r} is over its start rate")
        self.tenant = tenant
        self.wait_s = wait_s


class TransitionRejected(StoreError):
    """The job is not where the caller expected it; nothing was changed."""

    def __init__(self, job_id: str, reason: str, current: JobRow | None) -> None:
        super().__init__(f"transition of {job_id} rejected: {reason}")
        self.job_id = job_id
        self.reason = reason
        self.current = current


@dataclass(frozen=True, slots=True)
class Transition:
    before: JobRow
    after: JobRow
    event: JobEvent | None  # None when nothing visible changed


@functools.cache
def _job_columns() -> tuple[str, ...]:
    """The row's column names, read once (``dataclasses.fields`` walks the class on every call:
    a visible share of the status poll's CPU)."""
    return tuple(f.name for f in fields(JobRow) if f.name != "result_body")
