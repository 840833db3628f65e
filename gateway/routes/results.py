"""Results: ``GET /{collection}/{id}`` with the bearer key or a signed URL (SPEC §6)."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Request, Response, get
from litestar.datastructures import ETag
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import ResponseSpec
from litestar.params import Parameter
from litestar.response import File

from gateway.auth import bearer_tenant, unauthorized
from gateway.openapi import problems
from gateway.problems import ProblemError, not_found
from gateway.render import RESULT_PURPOSE, etag_matches
from gateway.routes.jobs import find_job
from gateway.services import services
from herald.store import JobRow
from workers.registry import JobKind


def _job_for_result(request: Request, job_id: str, exp: str | None, sig: str | None) -> JobRow:
    svc = services(request)
    if sig is not None or exp is not None:
        if not svc.signer.verify(request.url.path, RESULT_PURPOSE, exp, sig):
            raise ProblemError(403, "/problems/invalid-signature", "Invalid or expired signature",
                               "this signed URL is not valid (tampered or expired); get a fresh one from the job status")
        job = svc.store.get(job_id)
        if job is None:
            raise not_found("result")
        return job
    tenant = bearer_tenant(request, svc.settings)
    if tenant is None:
        raise unauthorized("send Authorization: Bearer <key> or use the signed links.result URL")
    return find_job(svc, tenant, job_id)


async def serve_result(request: Request, kind: JobKind, job_id: str, exp: str | None, sig: str | None) -> Any:
    svc = services(request)
    job = _job_for_result(request, job_id, exp, sig)
    if job.kind != kind.name:
        raise not_found("result")
    if job.state in ("queued", "running"):
        raise ProblemError(404, "/problems/result-not-ready", "Result not ready",
                           f"the job is {job.state}; poll /jobs/{job.id} until it answers 303",
                           headers={"Retry-After": "1"})
    if job.state != "succeeded" or job.result_path is None:
        raise ProblemError(404, "/problems/no-result", "No result", f"the job ended {job.state} and has no result")
    tag = f'"{job.id}-{job.attempt}"'
    if etag_matches(request.headers.get("if-none-match"), tag):
        return Response(None, status_code=304, headers={"ETag": tag})
    path = svc.results.path(job.result_path)
    if not path.exists():
        raise ProblemError(410, "/problems/gone", "Gone", "the result was removed (retention)")
    return File(
        path,
        filename=f"{kind.name}-{job.id}{path.suffix}",
        media_type=job.media_type or "application/octet-stream",
        content_disposition_type="attachment",
        etag=ETag(value=f"{job.id}-{job.attempt}"),
        headers={"Cache-Control": "private, max-age=3600"},
    )


def result_route(kind: JobKind) -> HTTPRouteHandler:
    async def download(
        request: Request,
        job_id: str,
        exp: Annotated[str | None, Parameter(query="exp", max_length=12)] = None,
        sig: Annotated[str | None, Parameter(query="sig", max_length=100)] = None,
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
            **problems(400, 401, 403, 404, 410),
        },
    )(download)
