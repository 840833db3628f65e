"""The status resource, the job list and cancellation (SPEC §4, §5)."""

from __future__ import annotations

from typing import Annotated

from litestar import Request, Response, delete, get
from litestar.openapi import ResponseSpec
from litestar.params import FromPath, QueryParameter
from litestar.status_codes import HTTP_200_OK, HTTP_202_ACCEPTED

from gateway.answers import StatusAnswer, status_answer
from gateway.auth import held_for_owner, require_scoped, require_tenant
from herald.tenants import SCOPE_JOBS_READ, SCOPE_JOBS_WRITE
from gateway.cursors import decode_position, encode_position
from gateway.ids import is_uuid, kind_filter
from gateway.openapi import problems
from gateway.problems import Conflict, Gone, InvalidRequest, JobFinished, NotFound
from gateway.render import etag, etag_matches, if_none_match_of, public_status
from gateway.services import Services, services
from herald.jobs import JobRow, TransitionRejected
from herald.transitions import Change
from schemas import FieldError, JobList, JobStatus
from schemas.jobs import JOB_STATES

_STATE_CHOICES = f"{', '.join(JOB_STATES[:-1])} or {JOB_STATES[-1]}"


async def find_job(svc: Services, tenant: str, job_id: str) -> JobRow:
    """The tenant's job, or 404 (unknown, or another tenant's) / 410 (deleted after retention)."""
    if not is_uuid(job_id):
        raise NotFound("no such job")
    job = await svc.store.get_for_tenant(tenant, job_id)
    if job is not None:
        return job
    if await svc.store.tombstone_tenant(job_id) == tenant:
        raise Gone("this job ended and its retention period has passed")
    raise NotFound("no such job")


async def find_signed_job(svc: Services, job_id: str) -> JobRow:
    """The job a verified signed link names, whichever tenant's (the signature is the
    permission), or 404 (never was) / 410 (deleted after retention), as ``find_job`` answers
    a key: every signed link of a deleted job (result, events, output) says it is gone."""
    job = await svc.store.get(job_id) if is_uuid(job_id) else None
    if job is not None:
        return job
    if is_uuid(job_id) and await svc.store.tombstone_tenant(job_id) is not None:
        raise Gone("this job ended and its retention period has passed")
    raise NotFound("no such job")


async def _version(svc: Services, job_id: str) -> int | None:
    job = await svc.store.get(job_id)
    return job.version if job is not None else None


async def status_response(job: JobRow, svc: Services, if_none_match: str | None) -> Response[JobStatus]:
    reason = await svc.queue_reasons.reason(job)
    return answer_response(status_answer(job, svc.signer, queued_reason=reason), if_none_match)


def answer_response(answer: StatusAnswer, if_none_match: str | None) -> Response[JobStatus]:
    """The response for ``answer``: a 303 once succeeded, else 200, or 304 when the tag matches."""
    if answer.status_code == 200 and etag_matches(if_none_match, answer.tag):
        return Response(None, status_code=304, headers=answer.headers)  # type: ignore[arg-type]
    # The body is the status already encoded (gateway/answers.py); Litestar sends bytes as they are.
    return Response(answer.body, status_code=answer.status_code, headers=answer.headers)  # type: ignore[arg-type]


@get("/jobs/{job_id:str}", operation_id="get_job", tags=["jobs"], summary="Job status (the source of truth)",
     status_code=200,
     responses={
         303: ResponseSpec(JobStatus, description="Succeeded: Location is the result", generate_examples=False),
         304: ResponseSpec(None, description="Not modified (If-None-Match), or a long poll that timed out"),
         **problems(400, 401, 404, 410, 429),
     })
async def get_job(
    request: Request,
    job_id: FromPath[str],
    wait: Annotated[int | None, QueryParameter(name="wait", ge=1, le=60, description="long poll: hold up to this many seconds while If-None-Match matches")] = None,
) -> Response[JobStatus]:
    """200 while queued/running (with Retry-After), 303 to the result once succeeded, 200 failed/cancelled."""
    svc = services(request)
    tenant = require_tenant(request, svc, SCOPE_JOBS_READ)
    job = await find_job(svc, tenant, job_id)
    if_none_match = if_none_match_of(request)
    # Held only for a tag of a version: `*` matches every version, so no change could end the
    # poll with anything but the 304 it gets now.
    if wait is not None and not job.terminal and etag_matches(if_none_match, etag(job), any_version=False):
        svc.limiter.open_stream(tenant)
        seen: int | None = None  # as if the wait ran out, when the client leaves before it does
        try:
            # 401 once the key is revoked, as a held stream ends; left early once the client is gone
            async with held_for_owner(request):
                seen = await svc.hub.wait_for_version(job.id, job.version, wait, reread=lambda: _version(svc, job_id))
        finally:
            svc.limiter.close_stream(tenant)
        if seen is not None:
            # Every poll this change woke shares one read and one encoded answer.
            answer = await svc.answers.answer(svc.store, svc.signer, job.id, seen)
            if answer is None:
                return await status_response(job, svc, if_none_match)
            if answer.job.state != "queued":
                return answer_response(answer, if_none_match)
            job = answer.job  # queued again (re-queued): its reason is this poll's own
        else:
            job = await svc.store.get(job.id) or job
    return await status_response(job, svc, if_none_match)


@get("/jobs", operation_id="list_jobs", tags=["jobs"], summary="The tenant's jobs, newest first",
     responses=problems(400, 401))
async def list_jobs(
    request: Request,
    job_state: Annotated[str | None, QueryParameter(name="state", description=_STATE_CHOICES)] = None,
    kind: Annotated[str | None, QueryParameter(name="kind", max_length=64)] = None,
    limit: Annotated[int, QueryParameter(name="limit", ge=1, le=100)] = 20,
    cursor: Annotated[str | None, QueryParameter(name="cursor", max_length=200)] = None,
) -> JobList:
    svc = services(request)
    tenant = require_tenant(request, svc, SCOPE_JOBS_READ)
    if job_state is not None and job_state not in JOB_STATES:
        raise InvalidRequest([FieldError(field="state", message=f"must be one of {', '.join(JOB_STATES)}")])
    before = decode_position(cursor) if cursor is not None else None  # empty: no cursor given out, a 400
    rows = await svc.store.list_jobs(tenant, state=job_state, kind=kind_filter(kind), before=before, limit=limit + 1)
    page = rows[:limit]
    return JobList(
        items=[public_status(job, svc.signer, queued_reason=await svc.queue_reasons.reason(job)) for job in page],
        next_cursor=encode_position(page[-1].created_at, page[-1].id) if len(rows) > limit else None,
    )


# The status a cancel answers with is a snapshot, with signed links in it, as GET's is (no-store there too).
_NOT_STORED = {"Cache-Control": "no-store"}


@delete("/jobs/{job_id:str}", operation_id="cancel_job", tags=["jobs"], summary="Cancel a job", status_code=200,
        responses={
            202: ResponseSpec(JobStatus, description="Running: cancellation requested", generate_examples=False),
            **problems(401, 404, 409, 410),
        })
async def cancel_job(request: Request, job_id: FromPath[str]) -> Response[JobStatus]:
    """Queued: cancelled at once (200). Running: cancel requested (202), the worker stops between steps."""
    svc = services(request)
    principal = require_scoped(request, svc, SCOPE_JOBS_WRITE)
    tenant, signed = principal.tenant, SCOPE_JOBS_READ in principal.scopes  # signed links: for a reader only
    for _ in range(5):  # the job may move between our read and our write: read again
        job = await find_job(svc, tenant, job_id)
        try:
            if job.state == "queued":
                done = await svc.store.transition(job.id, Change(expect={"queued"}, to="cancelled"))
                return Response(public_status(done.after, svc.signer, signed=signed), status_code=HTTP_200_OK,
                                headers=_NOT_STORED)
            if job.state == "running":
                if not job.cancel_requested:
                    job = (await svc.store.transition(
                        job.id, Change(expect={"running"}, attempt=job.attempt, cancel_requested=True))).after
                return Response(public_status(job, svc.signer, signed=signed), status_code=HTTP_202_ACCEPTED,
                                headers=_NOT_STORED)
        except TransitionRejected:
            continue
        if job.state == "cancelled":
            return Response(public_status(job, svc.signer, signed=signed), status_code=HTTP_200_OK,
                            headers=_NOT_STORED)
        raise JobFinished(f"the job is {job.state}; only queued or running jobs can be cancelled")
    raise Conflict("the job kept changing; try again")
