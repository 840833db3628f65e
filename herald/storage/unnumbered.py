"""A job's event encoded before its tenant-wide ``seq`` is known, and its outbox payload
completed once it is: so the encoding (the status object, its times in RFC 3339) is done
before a store's write, not inside it. PostgreSQL numbers after commit (its relay adds
the head); SQLite numbers under its write lock, where every microsecond is every
process's wait (bench/RESULTS.md, issue 24)."""

from __future__ import annotations

import msgspec

from herald.jobs import JobRow
from herald.timefmt import rfc3339
from schemas import JobEvent

SEQ_HEAD = b'{"seq":0,'
_encoder = msgspec.json.Encoder()


def unnumbered_event(job: JobRow, kind_of_change: str) -> tuple[JobEvent, bytes]:
    """The job's event for its current version at seq 0, and its JSON minus the
    ``{"seq":N,`` head (``numbered_payload`` puts it back)."""
    event = JobEvent(
        seq=0,
        tenant=job.tenant,
        job_id=job.id,
        kind=job.kind,
        version=job.version,
        type=kind_of_change,
        at=rfc3339(job.updated_at) or "",
        data=msgspec.Raw(_encoder.encode(job.status())),
    )
    payload = _encoder.encode(event)
    assert payload.startswith(SEQ_HEAD), "JobEvent must encode seq first"
    return event, payload[len(SEQ_HEAD):]


def numbered_payload(seq: int, tail: bytes) -> bytes:
    """The event's JSON at ``seq``: byte for byte what encoding it whole would give."""
    return b'{"seq":%d,' % seq + tail
