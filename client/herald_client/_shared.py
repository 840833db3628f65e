"""What both client shells share besides the flows: arguments in, requests out."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

from herald_client.models import JobStatus


class _Auto(enum.Enum):
    AUTO = "auto"


AUTO = _Auto.AUTO
"""``submit(..., idempotency_key=AUTO)``: a fresh UUID key, so a lost answer can be retried safely."""

IdempotencyKey = str | None | _Auto


def job_id(job: JobStatus | str) -> str:
    """The job's id as one path segment of ``/jobs/{id}`` (``path_segment``)."""
    return path_segment(job.id if isinstance(job, JobStatus) else job, "job")


def bearer(key: str) -> dict[str, str]:
    """The Authorization header for ``key``, or a ValueError: a key an HTTP header cannot carry
    (not printable ASCII, or with a space) failed only at the first request, in httpx's encoder."""
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        raise ValueError("the key must be printable ASCII without spaces (as Herald's keys are)")
    return {"Authorization": f"Bearer {key}"}


def path_segment(value: str, argument: str) -> str:
    """``value`` as one path segment, or a ValueError naming ``argument``. Empty, it would drop
    out of the path (``/admin/tenants//keys``) and '.' or '..' would be folded away by the URL
    (``/jobs/..`` is ``/``): another route's answer, a 404 or 405 that names the wrong thing."""
    if not value:
        raise ValueError(f"{argument} is empty: give its id")
    return quote(value, safe="").replace(".", "%2E")


def collection_path(kind: str, collections: Mapping[str, str]) -> str:
    """The start path of a kind: given explicitly (``/reports``), configured, or ``/<kind>s``."""
    if kind.startswith("/"):
        return kind
    return collections.get(kind, f"/{kind}s")


def encode_params(params: Mapping[str, Any] | msgspec.Struct) -> bytes:
    return msgspec.json.encode(params)


def resolve_key(idempotency_key: IdempotencyKey) -> str | None:
    return str(uuid.uuid4()) if idempotency_key is AUTO else idempotency_key


def url_for(base_url: str, path: str) -> str:
    if path.startswith(("http://", "https://")):
        return path
    return base_url.rstrip("/") + path


def reply_headers(headers: httpx.Headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def describe(exc: httpx.RequestError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
