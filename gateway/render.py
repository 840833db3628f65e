"""The status object as the API shows it: stored snapshot plus freshly signed links."""

from __future__ import annotations

from litestar import Request
from litestar.datastructures import CacheControlHeader

from herald.signing import UrlSigner
from herald.jobs import JobRow
from herald.timefmt import now
from schemas import JobStatus
from schemas.jobs import QueuedReason

# Answers that carry a secret or a signed link: never kept by a cache or a browser.
NO_STORE = CacheControlHeader(no_store=True)

EVENTS_PURPOSE = "events"
RESULT_PURPOSE = "result"
OUTPUT_PURPOSE = "output"


def public_status(
    job: JobRow, signer: UrlSigner, now: float | None = None, queued_reason: QueuedReason | None = None,
    *, signed: bool = True,
) -> JobStatus:
    """``now``: the instant the links are signed at (default: this one). ``signed=False``: the
    links as plain paths, for a caller whose key may not read the job (no ``jobs:read``): a
    signed link opens its events, output or result without a key, which is reading it."""
    status = job.status()
    status.queued_reason = queued_reason
    if not signed:
        return status
    status.links.events = signer.sign(status.links.events, EVENTS_PURPOSE, now=now)
    status.links.output = signer.sign(f"/jobs/{job.id}/output", OUTPUT_PURPOSE, now=now)
    if status.links.result is not None:
        status.links.result = signer.sign(status.links.result, RESULT_PURPOSE, now=now)
    return status


def retry_after(job: JobRow, at: float | None = None) -> int:
    """Seconds a poller should wait: 1 while queued, growing slowly (to 10) for long runs."""
    if job.state == "queued":
        return 1
    return int(min(10, 1 + ((now() if at is None else at) - job.created_at) // 30))


def etag(job: JobRow) -> str:
    return f'W/"{job.version}"'


def if_none_match_of(request: Request) -> str | None:
    """Every ``If-None-Match`` line of the request as one list: it is a list field, so several
    lines mean what one line with their values joined by commas does (RFC 9110 §5.3), where
    reading only the first one missed a tag on the second."""
    lines = request.headers.getall("if-none-match", [])
    return ", ".join(lines) if lines else None


def etag_matches(header: str | None, tag: str, *, any_version: bool = True) -> bool:
    """``any_version``: whether ``*`` counts (it matches any current representation)."""
    if not header:
        return False
    # If-None-Match compares weakly (RFC 9110 §13.1.2): W/"x" matches "x", and "x" matches W/"x".
    plain = tag.removeprefix("W/")
    matching = (plain, "*") if any_version else (plain,)
    return any(candidate.strip().removeprefix("W/") in matching for candidate in header.split(","))
