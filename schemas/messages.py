"""Messages on NATS: work items on the JOBS stream, committed transitions on EVENTS."""

from __future__ import annotations

import msgspec


class JobMessage(msgspec.Struct, kw_only=True, array_like=True):
    job_id: str
    kind: str
    attempt: int


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
