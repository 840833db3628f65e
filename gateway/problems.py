"""Every error leaves the gateway as RFC 9457 problem+json. HTTP mapping happens only here."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from herald.jobs import StoreUnavailable
from schemas import FieldError, Problem
from schemas.problems import (
    ADMIN_ONLY, BAD_REQUEST, CONFLICT, ENV_KEY, INSUFFICIENT_SCOPE, TENANT_EXISTS, ENDPOINT_DISABLED, FORBIDDEN, GENERIC, GONE, IDEMPOTENCY_KEY_MISMATCH,
    IDEMPOTENCY_KEY_REQUIRED, INTERNAL, INVALID_CURSOR, INVALID_IDEMPOTENCY_KEY, INVALID_REQUEST,
    INVALID_SIGNATURE, JOB_FINISHED, LIMIT_REACHED, MALFORMED_JSON, METHOD_NOT_ALLOWED, MISDIRECTED, NOT_ACCEPTABLE, NOT_FOUND,
    NOT_READY, NO_RESULT, OVERLOADED, PAYLOAD_TOO_LARGE, PORTAL_SCOPE, RANGE_NOT_SATISFIABLE, RATE_LIMITED,
    REQUEST_TIMEOUT, RESULT_NOT_READY,
    STORE_UNAVAILABLE, TOO_MANY_STREAMS, UNAUTHORIZED, UNAVAILABLE, UNPROCESSABLE,
    UNSUPPORTED_MEDIA_TYPE, ProblemType,
)

log = logging.getLogger("herald.gateway")

PROBLEM_MEDIA_TYPE = "application/problem+json"
# A route handler's ``opt`` entry: True, or a function of the request, when a request to it asks
# for an event stream (an SSE route, or one that streams by ``Accept``).
EVENT_STREAM_OPT = "event_stream"

# An error the framework raises gets the type of its status.
_FRAMEWORK_TYPES: Mapping[int | None, ProblemType] = {
    problem_type.status: problem_type
    for problem_type in (
        BAD_REQUEST, UNAUTHORIZED, FORBIDDEN, NOT_FOUND, METHOD_NOT_ALLOWED, NOT_ACCEPTABLE, CONFLICT,
        PAYLOAD_TOO_LARGE, UNSUPPORTED_MEDIA_TYPE, UNPROCESSABLE, RATE_LIMITED, INTERNAL, UNAVAILABLE,
    )
}
_SERVER_ERROR_DETAIL = "the server could not answer this request"


class ProblemError(HTTPException):
    """Raise anywhere in the gateway to answer with a problem: one subclass per problem type.

    ``kind`` is the type's entry in ``schemas.problems`` (URI, title, status); an instance
    adds the detail and what may come with it: field errors, headers, ``Retry-After``.
    """

    kind: ClassVar[ProblemType]

    def __init__(
        self,
        detail: str,
        *,
        errors: list[FieldError] | None = None,
        headers: Mapping[str, str] | None = None,
        retry_after: int | None = None,
    ) -> None:
        assert self.kind.status is not None, f"{self.kind.type} is not an answer to a request"
        all_headers = dict(headers or {})
        if retry_after is not None:
            all_headers["Retry-After"] = str(retry_after)
        super().__init__(status_code=self.kind.status, detail=detail, headers=all_headers)
        self.problem = self.kind.problem(detail, errors)


class InvalidRequest(ProblemError):
    kind = INVALID_REQUEST

    def __init__(self, errors: list[FieldError] | None = None, *, detail: str | None = None) -> None:
        names = ", ".join(e.field for e in errors or ())
        super().__init__(detail or f"invalid fields: {names}", errors=errors)


class MalformedJson(ProblemError):
    kind = MALFORMED_JSON


class InvalidCursor(ProblemError):
    """A ``cursor`` query parameter no list of this server gave out (named in ``errors``, as an
    invalid field is)."""

    kind = INVALID_CURSOR

    def __init__(self, detail: str = "cursor is not one this server gave out") -> None:
        super().__init__(detail, errors=[FieldError(field="cursor", message="not a next_cursor this server gave out")])


class IdempotencyKeyRequired(ProblemError):
    kind = IDEMPOTENCY_KEY_REQUIRED


class InvalidIdempotencyKey(ProblemError):
    kind = INVALID_IDEMPOTENCY_KEY


class Unauthorized(ProblemError):
    kind = UNAUTHORIZED

    def __init__(self, detail: str = "send Authorization: Bearer <key>") -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="herald"'})


class InvalidSignature(ProblemError):
    kind = INVALID_SIGNATURE


class PortalScope(ProblemError):
    kind = PORTAL_SCOPE

    def __init__(self, detail: str = "a portal session opens the /webhooks routes only; use an API key") -> None:
        super().__init__(detail)


class InsufficientScope(ProblemError):
    kind = INSUFFICIENT_SCOPE

    def __init__(self, scope: str) -> None:
        super().__init__(f"this key lacks the scope {scope}, which this route needs")


class AdminOnly(ProblemError):
    kind = ADMIN_ONLY

    def __init__(self, detail: str = "the /admin routes take the operator's HERALD_ADMIN_KEY, not a tenant's key") -> None:
        super().__init__(detail)


class TenantExists(ProblemError):
    kind = TENANT_EXISTS


class EnvKey(ProblemError):
    kind = ENV_KEY


class NotFound(ProblemError):
    kind = NOT_FOUND


class ResultNotReady(ProblemError):
    kind = RESULT_NOT_READY


class NoResult(ProblemError):
    kind = NO_RESULT


class RangeNotSatisfiable(ProblemError):
    """A result's ``Range`` that starts past its end (RFC 9110 §15.5.17): with the size."""

    kind = RANGE_NOT_SATISFIABLE

    def __init__(self, size: int) -> None:
        super().__init__(f"the result has {size} bytes: a range must start before its end",
                         headers={"Content-Range": f"bytes */{size}"})


class Conflict(ProblemError):
    kind = CONFLICT


class JobFinished(ProblemError):
    kind = JOB_FINISHED


class EndpointDisabled(ProblemError):
    kind = ENDPOINT_DISABLED


class LimitReached(ProblemError):
    kind = LIMIT_REACHED


class Gone(ProblemError):
    kind = GONE


class RequestTimeout(ProblemError):
    kind = REQUEST_TIMEOUT


class UnsupportedMediaType(ProblemError):
    kind = UNSUPPORTED_MEDIA_TYPE


class Misdirected(ProblemError):
    """A request naming a Host that a loopback-bound gateway does not answer (``gateway.middleware``)."""

    kind = MISDIRECTED


class IdempotencyKeyMismatch(ProblemError):
    kind = IDEMPOTENCY_KEY_MISMATCH


class RateLimited(ProblemError):
    kind = RATE_LIMITED


class TooManyStreams(ProblemError):
    kind = TOO_MANY_STREAMS


class Unavailable(ProblemError):
    kind = UNAVAILABLE


class Overloaded(ProblemError):
    kind = OVERLOADED


class NotReady(ProblemError):
    kind = NOT_READY


def problem_response(problem: Problem, headers: Mapping[str, str] | None = None) -> Response[Problem]:
    return Response(
        content=problem,
        status_code=problem.status or 500,
        media_type=PROBLEM_MEDIA_TYPE,
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


def _field_errors(exc: HTTPException) -> list[FieldError]:
    """The fields Litestar's own validation of a route's parameters (``?limit=101``, a path id
    that is no UUID) found wrong, as its ``ValidationException`` lists them."""
    if not isinstance(exc, ValidationException) or not isinstance(exc.extra, list):
        return []
    return [FieldError(field=str(item["key"]), message=str(item.get("message") or "invalid"))
            for item in exc.extra if isinstance(item, dict) and item.get("key")]


def allow(methods: Iterable[str]) -> str:
    """An ``Allow`` value (RFC 9110 §10.2.1): the methods given, OPTIONS (answered on every
    route), and HEAD wherever GET is (``gateway.headers.edge`` answers it as GET)."""
    named = {method.strip().upper() for method in methods if method.strip()} | {"OPTIONS"}
    if "GET" in named:
        named.add("HEAD")
    return ", ".join(sorted(named))


def _completed_allow(headers: Mapping[str, str]) -> dict[str, str]:
    """A 405's headers with its ``Allow`` naming HEAD too where GET is allowed."""
    completed = {name: value for name, value in headers.items() if name.lower() != "allow"}
    given = next((value for name, value in headers.items() if name.lower() == "allow"), "")
    completed["Allow"] = allow(given.split(","))
    return completed


def handle_http_exception(request: Request, exc: HTTPException) -> Response[Problem]:
    if isinstance(exc, ProblemError):
        return problem_response(exc.problem, exc.headers)
    if errors := _field_errors(exc):
        return problem_response(InvalidRequest(errors).problem, exc.headers)
    status = exc.status_code
    kind = _FRAMEWORK_TYPES.get(status, GENERIC)
    detail = exc.detail if isinstance(exc.detail, str) and exc.detail else kind.title
    headers = exc.headers
    if status == 405:
        detail = f"{request.method} is not allowed on {request.url.path}"
        headers = _completed_allow(exc.headers or {})
    elif status == 404:
        detail = f"no route or resource at {request.url.path}"
    elif status >= 500:
        log.error("server error", extra={"path": request.url.path, "detail": str(exc.detail)})
        detail = _SERVER_ERROR_DETAIL
    return problem_response(kind.problem(detail, status=status), headers)


def asks_for_event_stream(request: Request) -> bool:
    """Whether the request's route answers it with an event stream (``EVENT_STREAM_OPT``)."""
    handler = request.scope.get("route_handler")
    wants = handler.opt.get(EVENT_STREAM_OPT) if handler is not None else None
    return bool(wants(request) if callable(wants) else wants)


def handle_unexpected(request: Request, exc: Exception) -> Response[Any]:
    if isinstance(exc, StoreUnavailable):
        # The store is starting, failing over or unreachable: the client can outwait it.
        log.warning("store unavailable", extra={"path": request.url.path, "detail": str(exc)})
        if asks_for_event_stream(request):
            # Any answer but 200 stops an EventSource for good (SPEC §8): `retry:` alone and the
            # end instead, and the browser asks again in 3 s (resuming by its Last-Event-ID).
            from gateway.sse import RETRY_FRAME, SSE_HEADERS  # gateway.sse imports this module

            return Response(RETRY_FRAME, status_code=200, media_type="text/event-stream", headers=dict(SSE_HEADERS))
        return problem_response(
            STORE_UNAVAILABLE.problem("the job store cannot be reached right now; retry shortly"),
            {"Retry-After": "1"},
        )
    log.exception("unhandled error", extra={"path": request.url.path})
    return problem_response(INTERNAL.problem(_SERVER_ERROR_DETAIL))
