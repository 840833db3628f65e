"""One base exception, ``HeraldError``; every failure the client reports is one of these.

``ProblemError`` and its subclasses carry the server's problem+json fields (``type``,
``title``, ``status``, ``detail``, ``errors``) plus ``retry_after`` and ``request_id``
from the answer's headers, and build their own message from them.
"""

from __future__ import annotations

from collections.abc import Mapping

from herald_client.models import FieldError, JobStatus, Problem


class HeraldError(Exception):
    """Base of every error raised by herald_client."""


class HeraldConnectionError(HeraldError):
    """The server could not be reached (or kept dropping the connection) within the retry budget."""

    def __init__(self, message: str, *, attempts: int) -> None:
        super().__init__(f"{message} (after {attempts} attempt{'s' if attempts != 1 else ''})")
        self.attempts = attempts


class ProtocolError(HeraldError):
    """The server answered something this client cannot read (not Herald, or a newer contract)."""


class ProblemError(HeraldError):
    """The server answered with an RFC 9457 problem."""

    def __init__(self, problem: Problem, *, status: int, retry_after: float | None = None,
                 request_id: str | None = None) -> None:
        self.problem = problem
        self.status = status
        self.type = problem.type
        self.title = problem.title
        self.detail = problem.detail
        self.errors: list[FieldError] = list(problem.errors or ())
        self.retry_after = retry_after
        self.request_id = request_id
        text = f"{status} {problem.title or problem.type}"
        if problem.detail:
            text += f": {problem.detail}"
        if self.errors:
            text += " [" + "; ".join(f"{e.field}: {e.message}" for e in self.errors) + "]"
        if request_id:
            text += f" (request id {request_id})"
        super().__init__(text)


class InvalidRequest(ProblemError):
    """400: a field, the body, a header or a query parameter is invalid (``errors`` names fields)."""


class Unauthorized(ProblemError):
    """401: no key, or an unknown, revoked or expired one, or a disabled tenant's."""


class Forbidden(ProblemError):
    """403: a tampered or expired signed URL; a key without the scope the route needs
    (``/problems/insufficient-scope``); a tenant key on ``/admin``."""


class NotFound(ProblemError):
    """404: no such job (or another tenant's), or no result yet / at all."""


class Conflict(ProblemError):
    """409: e.g. cancelling a job that already finished; a tenant id already taken;
    revoking a key of ``HERALD_API_KEYS`` (configuration)."""


class Gone(ProblemError):
    """410: the job ended and its retention period passed."""


class IdempotencyKeyMismatch(ProblemError):
    """422: this Idempotency-Key was used with a different request."""


class RateLimited(ProblemError):
    """429: still over the rate limit after the retry budget; ``retry_after`` says when to come back."""


class ServerError(ProblemError):
    """5xx that did not go away within the retry budget."""


_BY_STATUS: Mapping[int, type[ProblemError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    422: IdempotencyKeyMismatch,
    429: RateLimited,
}


def problem_class(status: int) -> type[ProblemError]:
    if status >= 500:
        return ServerError
    return _BY_STATUS.get(status, ProblemError)


class WaitTimeout(HeraldError):
    """``wait`` reached its timeout before the job ended; ``status`` is the last one seen."""

    def __init__(self, status: JobStatus | None, timeout: float) -> None:
        state = status.state if status is not None else "unknown"
        super().__init__(f"job still {state} after {timeout:g} s")
        self.status = status
        self.timeout = timeout


class JobNotSucceeded(HeraldError):
    """A result was asked for, but the job is not (or did not end) ``succeeded``.

    ``status.error`` holds the job's own problem when it failed.
    """

    def __init__(self, status: JobStatus) -> None:
        detail = f": {status.error.title} ({status.error.type})" if status.error is not None else ""
        super().__init__(f"job {status.id} is {status.state}{detail}")
        self.status = status


class WebhookVerificationError(HeraldError):
    """A webhook delivery failed verification: missing headers, stale timestamp or bad signature."""
