"""Results: ``GET /{collection}/{id}`` with the bearer key or a signed URL (SPEC §6).

The bytes come from the result store (local files or the NATS object store), streamed a
chunk at a time: a download never holds the whole result in the gateway's memory. A small
JSON result kept in the job's row (SQLite, ``JobStore.keeps_results``) is answered from it.
"""

from __future__ import annotations

import time
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
from gateway.problems import Gone, InvalidSignature, NoResult, NotFound, ResultNotReady, Unauthorized, Unavailable
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
    if etag_matches(if_none_match_of(request), tag):
        return Response(None, status_code=304, headers={"ETag": tag, **caching})
    media_type = job.media_type or "application/octet-stream"
    if job.result_body is not None:
        headers = {"Content-Type": _content_type(media_type),
                   "Content-Disposition": _attachment(f"{kind.name}-{job.id}.json"), "ETag": tag, **caching}
        return Response(job.result_body, media_type=media_type, headers=headers)
    assert job.result_path is not None
    body = await _open_result(request, job.result_path)
    filename = f"{kind.name}-{job.id}{PurePosixPath(job.result_path).suffix}"
    return Stream(
        body.chunks,
        media_type=media_type,
        headers={
            # Set here too: Stream lets the handler's default (JSON) override its media_type.
            "Content-Type": _content_type(media_type),
            "Content-Disposition": _attachment(filename),
            "Content-Length": str(body.size),  # known up front: the client sees a sized download, not chunked
            "ETag": tag,
            **caching,
        },
    )


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
            **problems(400, 401, 403, 404, 410, 503),
        },
    )(download)
