"""Messages on NATS: work items on the JOBS stream, committed transitions on EVENTS."""

from __future__ import annotations

import msgspec


class QueuedJob(msgspec.Struct, kw_only=True, array_like=True):
    """A job's row as it was committed queued, for the version its work message was made for
    (``herald.workmessage``): what a worker's claim is judged on without reading the row
    first. The row's ``callback_url`` is not carried (a URL may hold a credential, and no
    worker reads it); nor is what a queued row never has (a result, a finish, an expiry)."""

    tenant: str
    collection: str
    params: bytes
    progress: int | None
    version: int
    cancel_requested: bool
    created_at: float
    updated_at: float
    heartbeat_at: float | None
    deadline_at: float
    error: bytes | None
    traceparent: str | None
    tracestate: str | None


class JobMessage(msgspec.Struct, kw_only=True, array_like=True):
    job_id: str
    kind: str
    attempt: int
    # The job as queued (PostgreSQL's messages, a job whose params are small); None: the
    # worker reads the job (SQLite's, an older Herald's, large params). Last and optional,
    # so each Herald decodes the other's messages (msgspec ignores trailing array items).
    job: QueuedJob | None = None


class JobEvent(msgspec.Struct, kw_only=True):
    """One committed transition. ``data`` is the status object exactly as committed."""

    seq: int  # tenant-wide position, the /events cursor
    tenant: str
    job_id: str
    kind: str
    version: int
    type: str
    at: str
    data: msgspec.Raw
