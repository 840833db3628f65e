"""Starting jobs: one shared accept path, one route per registered kind (SPEC §3)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.exceptions import HTTPException
from litestar.handlers import HTTPRouteHandler

from gateway.auth import require_scoped
from herald.tenants import SCOPE_JOBS_READ, SCOPE_JOBS_WRITE
from gateway.bodies import read_body, url_errors
from gateway.openapi import problems, with_body
from gateway.problems import IdempotencyKeyMismatch, IdempotencyKeyRequired, InvalidIdempotencyKey, InvalidRequest, Overloaded
from gateway.render import public_status, retry_after
from gateway.services import Services, services
from herald import tracing
from herald.ids import new_id
from herald.jobs import Accepted, IdempotencyClaim, IdempotencyMismatch, JobRow, NewJob, RateLimited
from schemas import JobStatus
from herald.kinds import KindDeclaration as JobKind

IDEMPOTENCY_HEADER = "idempotency-key"
_MISMATCH = "this Idempotency-Key was used with a different request (path or body)"


def _idempotency_key(request: Request, required: bool) -> str | None:
    keys = request.headers.getall(IDEMPOTENCY_HEADER, [])
    if len(keys) > 1:
        # Which one the client meant cannot be told (the framework reads the first): a replay
        # under the other would start a second job.
        raise InvalidIdempotencyKey("send one Idempotency-Key header, not several")
    key = keys[0] if keys else None
    if key is None:
        if required:
            raise IdempotencyKeyRequired("this server requires an Idempotency-Key header on every start request")
        return None
    if not 1 <= len(key) <= 255 or not all(" " <= ch <= "~" for ch in key):
        raise InvalidIdempotencyKey("Idempotency-Key must be 1..255 printable ASCII characters")
    return key


def fingerprint(path: str, document: Any) -> str:
    canonical = msgspec.json.encode(document, order="sorted")
    return hashlib.sha256(path.encode() + b"\n" + canonical).hexdigest()


async def accept_job(request: Request, kind: JobKind) -> Response[JobStatus]:
    """The job's accept span (``herald.tracing``): a child of the request's ``traceparent``, or
    the root of a new trace; its context is kept with the job."""
    attributes = {"http.request.method": "POST", "http.route": kind.collection, "herald.job.kind": kind.name}
    with tracing.span(f"POST {kind.collection}", tracing.incoming(request.headers), kind=tracing.SpanKind.SERVER,
                      attributes=attributes, error_on_exception=False) as span:
        try:
            response = await _accept_job(request, kind)
        except HTTPException as exc:
            span.set_attribute("http.response.status_code", exc.status_code)
            raise
        span.set_attribute("http.response.status_code", response.status_code)
        if isinstance(response.content, JobStatus):
            span.set_attribute("herald.job.id", response.content.id)
        return response


async def _accept_job(request: Request, kind: JobKind) -> Response[JobStatus]:
    """Authenticate, validate, commit job + key + outbox in one transaction, answer 202."""
    svc = services(request)
    principal = require_scoped(request, svc, SCOPE_JOBS_WRITE)
    tenant = principal.tenant
    key = _idempotency_key(request, svc.settings.require_idempotency_key)
    params, document = await read_body(request, kind.params)
    claim = None
    if key is not None:
        claim = IdempotencyClaim(key=key, fingerprint=fingerprint(request.url.path, document), ttl_s=svc.settings.retention_s)
    # The same guard as a webhook registration: https to a public address (resolved now).
    if errors := await url_errors(svc.settings, svc.resolver, "callback_url", params.callback_url):
        # Unless this is the replay of a start the guard passed: its job exists, and a client
        # whose 202 was lost must learn it, not a 400 for a name that no longer resolves (or
        # resolves elsewhere) that would tell it nothing was started. The notifier judges the
        # callback's address again at each delivery.
        replayed = await _replay(svc, tenant, claim) if claim is not None else None
        if replayed is None:
            raise InvalidRequest(errors)
        return _accepted(svc, principal.scopes, kind, Accepted(job=replayed, replayed=True))
    try:
        await svc.backlog.check(kind.name, tenant)
    except Overloaded:
        # Back-pressure refuses new work, not the answer to work already accepted: a client
        # whose 202 was lost retries with its key, and must learn its job (the oldest in the
        # backlog, perhaps) rather than be told 503 until the backlog drains. A replay found
        # here starts nothing and spends no start token; a mismatch is the 422 it always is.
        replayed = await _replay(svc, tenant, claim) if claim is not None else None
        if replayed is None:
            raise
        return _accepted(svc, principal.scopes, kind, Accepted(job=replayed, replayed=True))
    new = NewJob(
        id=new_id(),
        tenant=tenant,
        kind=kind.name,
        collection=kind.collection,
        params=msgspec.json.encode(params),
        deadline_s=kind.deadline_s or svc.settings.job_deadline_s,
        callback_url=params.callback_url,
        **tracing.job_fields(),
    )
    try:
        # The start token is spent in the accept transaction, from one budget shared by every
        # gateway; a request refused for any other reason (above, or a mismatch) spends none.
        with tracing.span("store accept", kind=tracing.SpanKind.CLIENT,
                          attributes={"db.system.name": "postgresql" if svc.settings.database_url else "sqlite"}):
            accepted: Accepted = await svc.store.accept(new, claim, svc.limiter.start_budget(tenant))
    except RateLimited as exc:
        raise svc.limiter.rate_limited(tenant, exc.wait_s) from exc
    except IdempotencyMismatch as exc:
        raise IdempotencyKeyMismatch(_MISMATCH) from exc
    return _accepted(svc, principal.scopes, kind, accepted)


async def _replay(svc: Services, tenant: str, claim: IdempotencyClaim) -> JobRow | None:
    try:
        return await svc.store.find_replay(tenant, claim)
    except IdempotencyMismatch as exc:
        raise IdempotencyKeyMismatch(_MISMATCH) from exc


def _accepted(svc: Services, scopes: frozenset[str], kind: JobKind, accepted: Accepted) -> Response[JobStatus]:
    """The 202 of a start or of a replay."""
    job = accepted.job
    headers = {
        "Location": f"/jobs/{job.id}",
        "Retry-After": str(retry_after(job)),
        "Cache-Control": "no-store",
    }
    if accepted.replayed:
        headers["Idempotent-Replayed"] = "true"
    else:
        svc.metrics.jobs_accepted.labels(kind=kind.name).inc()
    # Signed links only for a key that may read the job (a replay's links.result is its result).
    status = public_status(job, svc.signer, signed=SCOPE_JOBS_READ in scopes)
    return Response(status, status_code=202, headers=headers)


def accept_route(kind: JobKind) -> HTTPRouteHandler:
    async def start(request: Request) -> Response[JobStatus]:
        return await accept_job(request, kind)

    start.__doc__ = (
        f"Start a {kind.name} job. Answers 202 at once with the status object; poll Location, "
        f"stream links.events, or wait for a webhook. Body: {kind.params.__name__}."
    )
    return post(
        kind.collection,
        status_code=202,
        operation_id=f"start_{kind.name}",
        summary=f"Start a {kind.name} job",
        tags=["jobs"],
        name=f"start-{kind.name}",
        responses=problems(400, 401, 413, 415, 422, 429, 503),
        operation_class=with_body(kind.params, f"The {kind.name} parameters"),
    )(start)
