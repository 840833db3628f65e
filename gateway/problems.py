"""Every error leaves the gateway as RFC 9457 problem+json. HTTP mapping happens only here."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from litestar import Request, Response
from litestar.exceptions import HTTPException

from herald.jobs import StoreUnavailable
from schemas import FieldError, Problem

log = logging.getLogger("herald.gateway")

PROBLEM_MEDIA_TYPE = "application/problem+json"

# Framework errors get a stable type of their own.
_TYPES_BY_STATUS: Mapping[int, tuple[str, str]] = {
    400: ("/problems/bad-request", "Bad request"),
    401: ("/problems/unauthorized", "Authentication required"),
    403: ("/problems/forbidden", "Forbidden"),
    404: ("/problems/not-found", "Not found"),
    405: ("/problems/method-not-allowed", "Method not allowed"),
    406: ("/problems/not-acceptable", "Not acceptable"),
    409: ("/problems/conflict", "Conflict"),
    413: ("/problems/payload-too-large", "Request body too large"),
    415: ("/problems/unsupported-media-type", "Unsupported media type"),
    422: ("/problems/unprocessable", "Unprocessable request"),
    429: ("/problems/rate-limited", "Too many requests"),
    500: ("/problems/internal", "Internal server error"),
    503: ("/problems/unavailable", "Service unavailable"),
}


class ProblemError(HTTPException):
    """Raise anywhere in the gateway to answer with a problem."""

    def __init__(
        self,
        status: int,
        type_: str,
        title: str,
        detail: str,
        *,
        errors: list[FieldError] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=status, detail=detail, headers=dict(headers or {}))
        self.problem = Problem(type=type_, title=title, status=status, detail=detail, errors=errors)


def invalid_request(errors: list[FieldError]) -> ProblemError:
    names = ", ".join(e.field for e in errors)
    return ProblemError(400, "/problems/invalid-request", "Invalid request", f"invalid fields: {names}", errors=errors)


def not_found(what: str = "job") -> ProblemError:
    return ProblemError(404, "/problems/not-found", "Not found", f"no such {what}")


def problem_response(problem: Problem, headers: Mapping[str, str] | None = None) -> Response[Problem]:
    return Response(
        content=problem,
        status_code=problem.status or 500,
        media_type=PROBLEM_MEDIA_TYPE,
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


def handle_http_exception(request: Request, exc: HTTPException) -> Response[Problem]:
    if isinstance(exc, ProblemError):
        return problem_response(exc.problem, exc.headers)
    status = exc.status_code
    type_, title = _TYPES_BY_STATUS.get(status, ("/problems/error", "Error"))
    detail = exc.detail if isinstance(exc.detail, str) and exc.detail else title
    if status == 405:
        detail = f"{request.method} is not allowed on {request.url.path}"
    elif status == 404:
        detail = f"no route or resource at {request.url.path}"
    elif status >= 500:
        log.error("server error", extra={"path": request.url.path, "detail": str(exc.detail)})
        detail = "the server could not answer this request"
    return problem_response(Problem(type=type_, title=title, status=status, detail=detail), exc.headers)


def handle_unexpected(request: Request, exc: Exception) -> Response[Problem]:
    if isinstance(exc, StoreUnavailable):
        # The store is starting, failing over or unreachable: the client can outwait it.
        log.warning("store unavailable", extra={"path": request.url.path, "detail": str(exc)})
        return problem_response(
            Problem(type="/problems/store-unavailable", title="Store unavailable", status=503,
                    detail="the job store cannot be reached right now; retry shortly"),
            {"Retry-After": "1"},
        )
    log.exception("unhandled error", extra={"path": request.url.path})
    return problem_response(
        Problem(type="/problems/internal", title="Internal server error", status=500,
                detail="the server could not answer this request")
    )
