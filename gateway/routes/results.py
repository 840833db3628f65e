"""Results: ``GET /{collection}/{id}`` with the bearer key or a signed URL (SPEC §6).

The bytes come from the result store (local files or the NATS object store), streamed a
chunk at a time: a download never holds the whole result in the gateway's memory. A small
JSON result kept in the job's row (SQLite, ``JobStore.keeps_results``) is answered from it.

One byte range (``Range: bytes=…``, RFC 9110 §14) is answered ``206`` with that part, so a
download cut off can be resumed (``curl -C -``, a browser's resume) rather than fetched
whole again; ``If-Range`` with another tag than the result's, several ranges, another unit
or a malformed range get the whole result (``200``), as §14.2 allows; a range that starts
past the end is ``416`` with ``Content-Range: bytes */<size>``. The bytes before the range
are read and dropped (a file, or the object store's chunks in order): ranges are rare, and
the result store keeps one way to read a result.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import PurePosixPath
from typing import Annotated, Any
from urllib.parse import quote

from litestar import Request, Response, get
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import ResponseSpec
from litestar.params import FromPath, QueryParameter
from litestar.response import Stream

from gateway.auth import bearer_tenant
from herald.tenants import SCOPE_JOBS_READ
from gateway.openapi import problems
from gateway.problems import (
    Gone, InvalidSignature, NoResult, NotFound, RangeNotSatisfiable, ResultNotReady, Unauthorized, Unavailable,
)
from gateway.render import RESULT_PURPOSE, etag_matches, if_none_match_of
from gateway.routes.jobs import find_job, find_signed_job
from gateway.services import services
from herald.jobs import JobRow
from herald.storage.ports import ResultBody
from herald.storage.results import ResultStoreUnavailable
from herald.kinds import KindDeclaration as JobKind


async def _job_for_result(request: Request, job_id: str, exp: str | None, sig: str | None) -> JobRow:
    svc = services(request)
    if sig is not None or exp is not None:
        if not svc.signer.verify(request.url.path, RESULT_PURPOSE, exp, sig):
            raise InvalidSignature("this signed URL is not valid (tampered or expired); get a fresh one from the job status")
        job = await find_signed_job(svc, job_id)
        if svc.directory.disabled(job.tenant):  # as its keys and its signed stream links (SPEC §12)
            raise Unauthorized("this signed link's tenant is disabled")
        return job
    tenant = bearer_tenant(request, svc, SCOPE_JOBS_READ)
    if tenant is None:
        raise Unauthorized("send Authorization: Bearer <key> or use the signed links.result URL")
    return await find_job(svc, tenant, job_id)


def _cache_control(exp: str | None) -> str:
    """A signed URL's answer may be kept only until its ``exp`` (verified: ASCII digits), and
    only by the browser; a bearer download is the browser's only, revalidated on each use
    (a cheap 304 by its ETag) so that a revoked key stops it at once."""
    if exp is None:
        return "private, no-cache"
    return f"private, max-age={max(0, int(exp) - int(time.time()))}"


async def serve_result(request: Request, kind: JobKind, job_id: str, exp: str | None, sig: str | None) -> Any:
    job = await _job_for_result(request, job_id, exp, sig)
    caching = {"Cache-Control": _cache_control(exp), "X-Content-Type-Options": "nosniff"}
    if job.kind != kind.name:
        raise NotFound("no such result")
    if not job.terminal:
        raise ResultNotReady(f"the job is {job.state}; poll /jobs/{job.id} until it answers 303", retry_after=1)
    if job.state != "succeeded" or (job.result_path is None and job.result_body is None):
        raise NoResult(f"the job ended {job.state} and has no result")
    tag = f'"{job.id}-{job.attempt}"'
    if etag_matches(if_none_match_of(request), tag):  # before Range (RFC 9110 §13.2.2)
        return Response(None, status_code=304, headers={"ETag": tag, **caching})
    media_type = job.media_type or "application/octet-stream"
    if job.result_body is not None:
        headers = {"Content-Type": _content_type(media_type),
                   "Content-Disposition": _attachment(f"{kind.name}-{job.id}.json"), "ETag": tag,
                   "Accept-Ranges": "bytes", **caching}
        part = byte_range(request, len(job.result_body), tag)
        if part is None:
            return Response(job.result_body, media_type=media_type, headers=headers)
        first, last = part
        headers["Content-Range"] = f"bytes {first}-{last}/{len(job.result_body)}"
        return Response(job.result_body[first:last + 1], status_code=206, media_type=media_type, headers=headers)
    assert job.result_path is not None
    body = await _open_result(request, job.result_path)
    filename = f"{kind.name}-{job.id}{PurePosixPath(job.result_path).suffix}"
    headers = {
        # Set here too: Stream lets the handler's default (JSON) override its media_type.
        "Content-Type": _content_type(media_type),
        "Content-Disposition": _attachment(filename),
        "Content-Length": str(body.size),  # known up front: the client sees a sized download, not chunked
        "ETag": tag,
        "Accept-Ranges": "bytes",
        **caching,
    }
    try:
        part = byte_range(request, body.size, tag)
    except RangeNotSatisfiable:
        await _close(body.chunks)
        raise
    if part is None:
        return Stream(body.chunks, media_type=media_type, headers=headers)
    first, last = part
    headers["Content-Range"] = f"bytes {first}-{last}/{body.size}"
    headers["Content-Length"] = str(last - first + 1)
    return Stream(_part(body.chunks, first, last), status_code=206, media_type=media_type, headers=headers)


# One range of bytes (RFC 9110 §14.1.2): first-last, first- or -suffix; the unit in any case.
# At most 19 digits: a larger number is past any result, and int() refuses over 4 300 digits.
_BYTE_RANGE = re.compile(r"[Bb][Yy][Tt][Ee][Ss]=[ \t]*([0-9]{1,19})?-([0-9]{1,19})?[ \t]*")


def byte_range(request: Request, size: int, tag: str) -> tuple[int, int] | None:
    """The one range of the result to answer ``206`` with (first and last byte, inclusive), or
    None for the whole result; ``RangeNotSatisfiable`` for a range that starts past its end."""
    sent = request.headers.getall("range", [])
    if len(sent) != 1 or (match := _BYTE_RANGE.fullmatch(sent[0])) is None:
        return None  # none, two lines, several ranges, another unit, malformed: the whole (§14.2)
    if_range = request.headers.getall("if-range", [])
    if if_range and (len(if_range) > 1 or if_range[0].strip() != tag):
        # Strong comparison (§13.1.5); a date never validates, since no Last-Modified is sent.
        return None
    first, last = match.group(1), match.group(2)
    if first is None:
        if last is None:
            return None  # "bytes=-": no range at all
        if int(last) == 0 or size == 0:
            raise RangeNotSatisfiable(size)
        return max(0, size - int(last)), size - 1
    start = int(first)
    if last is not None and int(last) < start:
        return None  # an invalid range: ignored
    if start >= size:
        raise RangeNotSatisfiable(size)
    return start, size - 1 if last is None else min(int(last), size - 1)


async def _part(chunks: AsyncIterator[bytes], first: int, last: int) -> AsyncIterator[bytes]:
    """Bytes ``first`` to ``last`` of the chunks, which are read from the start and closed at ``last``."""
    at = 0
    try:
        async for chunk in chunks:
            end = at + len(chunk)
            if end > first:
                yield chunk[max(0, first - at):last + 1 - at]
            at = end
            if at > last:
                return
    finally:
        await _close(chunks)


async def _close(chunks: AsyncIterator[bytes]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


async def _open_result(request: Request, key: str) -> ResultBody:
    try:
        body = await services(request).results.open(key)
    except ResultStoreUnavailable as exc:
        raise Unavailable("the result store is not reachable yet; try again shortly", retry_after=1) from exc
    if body is None:
        raise Gone("the result was removed (retention)")
    return body


def _content_type(media_type: str) -> str:
    """As litestar writes it for any response: text types carry their charset."""
    if media_type.startswith("text/") and "charset=" not in media_type:
        return f"{media_type}; charset=utf-8"
    return media_type


def _attachment(filename: str) -> str:
    """``Content-Disposition`` as litestar's ``File`` writes it (RFC 6266 ``filename*`` when not ASCII-safe)."""
    quoted = quote(filename)
    if quoted == filename:
        return f'attachment; filename="{filename}"'
    return f"attachment; filename*=utf-8''{quoted}"


def result_route(kind: JobKind) -> HTTPRouteHandler:
    async def download(
        request: Request,
        job_id: FromPath[str],
        exp: Annotated[str | None, QueryParameter(name="exp", max_length=12)] = None,
        sig: Annotated[str | None, QueryParameter(name="sig", max_length=100)] = None,
    ) -> Any:
        return await serve_result(request, kind, job_id, exp, sig)

    download.__doc__ = f"Download a finished {kind.name} (bearer key, or the signed links.result URL)."
    return get(
        f"{kind.collection}/{{job_id:str}}",
        operation_id=f"get_{kind.name}_result",
        summary=f"Download a {kind.name} result",
        tags=["results"],
        name=f"result-{kind.name}",
        responses={
            304: ResponseSpec(None, description="Not modified"),
            **problems(400, 401, 403, 404, 410, 416, 503),
        },
    )(download)
