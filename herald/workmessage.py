"""A job's work message (``schemas.JobMessage``): what the stores put in the outbox for the
JOBS stream, and what a worker takes from it.

A message may carry its job's row as queued (``QueuedJob``), for the version it was made
for. A worker then claims without reading the job first: the store judges the claim on the
carried row and compares-and-sets on its ``version`` and ``updated_at``
(``herald/storage/postgres/recent.py``), so a job that moved since (cancelled, deleted,
claimed elsewhere, re-queued) makes the write miss, and the row is read and judged again as
before. PostgreSQL's messages carry it (the read is a round trip, the largest statement per
job left on a worker's path); SQLite's do not (its read is a lookup in the process's own
file, and its claim reads the row in its own transaction whatever the message says).
"""

from __future__ import annotations

import msgspec

from herald.jobs import JobRow
from schemas import JobMessage, QueuedJob

# A job whose params are larger goes without its row, and its worker reads it: the second
# copy of the params (in the outbox row's WAL and in the JetStream message) would then cost
# more than the one round trip it saves.
CARRIED_PARAMS_MAX_BYTES = 4096

_decoder = msgspec.msgpack.Decoder(JobMessage)


def encode(job: JobRow, *, carry_row: bool) -> bytes:
    """The msgpack body of ``job``'s work message for its current attempt (``job`` is queued)."""
    carried = None
    if carry_row and len(job.params) <= CARRIED_PARAMS_MAX_BYTES:
        assert job.state == "queued", "a work message is made for a queued job"
        carried = QueuedJob(
            tenant=job.tenant, collection=job.collection, params=job.params, progress=job.progress,
            version=job.version, cancel_requested=job.cancel_requested, created_at=job.created_at,
            updated_at=job.updated_at, heartbeat_at=job.heartbeat_at, deadline_at=job.deadline_at,
            error=job.error, traceparent=job.traceparent, tracestate=job.tracestate,
        )
    return msgspec.msgpack.encode(JobMessage(job_id=job.id, kind=job.kind, attempt=job.attempt, job=carried))


def decode(body: bytes) -> JobMessage:
    """Raises ``msgspec.DecodeError`` on a body that is no work message."""
    return _decoder.decode(body)


def carried_row(work: JobMessage) -> JobRow | None:
    """The job's row as its message carries it (queued, at the message's version), or None.

    Its ``callback_url`` is None whatever the job has (not carried); every other column is the
    job's as committed at that version."""
    job = work.job
    if job is None:
        return None
    return JobRow(
        id=work.job_id, tenant=job.tenant, kind=work.kind, collection=job.collection, state="queued",
        params=job.params, progress=job.progress, version=job.version, attempt=work.attempt,
        cancel_requested=job.cancel_requested, created_at=job.created_at, updated_at=job.updated_at,
        heartbeat_at=job.heartbeat_at, deadline_at=job.deadline_at, finished_at=None, expires_at=None,
        result_path=None, media_type=None, error=job.error, callback_url=None,
        traceparent=job.traceparent, tracestate=job.tracestate,
    )
