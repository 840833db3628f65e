"""RFC 9457 problem details, and every problem type Herald can emit (one list, SPEC §10).

A ``ProblemType`` is the fact about one type: its URI (relative, under ``/problems/``),
its title and the HTTP status it answers with. The gateway raises one typed error per
type (``gateway.problems``) and documents each status with the types it can carry
(``gateway.openapi``); workers and the sweeper put the job error types in a failed job's
``error`` (those have no status: they are data in a status object, not an answer).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class FieldError(msgspec.Struct, kw_only=True):
    field: str
    message: str


class Problem(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    title: str
    status: int | None = None
    detail: str | None = None
    errors: list[FieldError] | None = None


@dataclass(frozen=True, slots=True)
class ProblemType:
    type: str
    title: str
    status: int | None = None  # None: a job's error, or (GENERIC) whatever status the error had
    note: str = ""  # for the API document: when it is sent, what comes with it

    def problem(self, detail: str, errors: list[FieldError] | None = None, *, status: int | None = None) -> Problem:
        return Problem(type=self.type, title=self.title, status=status or self.status, detail=detail, errors=errors)


_DEFINED: list[ProblemType] = []


def _define(type_: str, title: str, status: int | None = None, note: str = "") -> ProblemType:
    if any(known.type == type_ for known in _DEFINED):
        raise ValueError(f"problem type {type_} is defined twice")
    problem_type = ProblemType(type_, title, status, note)
    _DEFINED.append(problem_type)
    return problem_type


# ----- answers to requests -----------------------------------------------------------------

BAD_REQUEST = _define("/problems/bad-request", "Bad request", 400, "a parameter out of its range")
INVALID_REQUEST = _define("/problems/invalid-request", "Invalid request", 400, "`errors` names each bad field")
MALFORMED_JSON = _define("/problems/malformed-json", "Malformed JSON", 400)
INVALID_CURSOR = _define("/problems/invalid-cursor", "Invalid cursor", 400, "`errors` names the `cursor`")
IDEMPOTENCY_KEY_REQUIRED = _define("/problems/idempotency-key-required", "Idempotency-Key required", 400)
INVALID_IDEMPOTENCY_KEY = _define("/problems/invalid-idempotency-key", "Invalid Idempotency-Key", 400)
UNAUTHORIZED = _define("/problems/unauthorized", "Authentication required", 401, "missing or unknown key")
INVALID_SIGNATURE = _define("/problems/invalid-signature", "Invalid or expired signature", 403)
FORBIDDEN = _define("/problems/forbidden", "Forbidden", 403)
PORTAL_SCOPE = _define("/problems/portal-scope", "Outside the webhook portal", 403,
                       "a portal session token opens the tenant's /webhooks routes only")
INSUFFICIENT_SCOPE = _define("/problems/insufficient-scope", "Insufficient scope", 403,
                              "the key lacks the scope the route needs; the detail names it")
ADMIN_ONLY = _define("/problems/admin-only", "Admin key required", 403,
                     "an /admin route called with a tenant's key")
NOT_FOUND = _define("/problems/not-found", "Not found", 404, "also another tenant's resource")
RESULT_NOT_READY = _define("/problems/result-not-ready", "Result not ready", 404, "the job is queued or running; with Retry-After")
NO_RESULT = _define("/problems/no-result", "No result", 404, "the job failed or was cancelled")
METHOD_NOT_ALLOWED = _define("/problems/method-not-allowed", "Method not allowed", 405)
NOT_ACCEPTABLE = _define("/problems/not-acceptable", "Not acceptable", 406)
CONFLICT = _define("/problems/conflict", "Conflict", 409)
TENANT_EXISTS = _define("/problems/tenant-exists", "Tenant exists", 409)
ENV_KEY = _define("/problems/env-key", "Key from configuration", 409,
                  "a HERALD_API_KEYS key is configuration: remove it there, not over the API")
JOB_FINISHED = _define("/problems/job-finished", "Job already finished", 409)
ENDPOINT_DISABLED = _define("/problems/endpoint-disabled", "Endpoint disabled", 409)
LIMIT_REACHED = _define("/problems/limit-reached", "Limit reached", 409,
                        "a per-tenant limit (SPEC §13) is used up, e.g. max_endpoints")
GONE = _define("/problems/gone", "Gone", 410, "the job, or its result, passed its retention")
REQUEST_TIMEOUT = _define("/problems/request-timeout", "Request timeout", 408,
                          "the head or the body of the request stopped arriving (30 s); the connection is closed")
PAYLOAD_TOO_LARGE = _define("/problems/payload-too-large", "Request body too large", 413, "body over 1 MiB")
UNSUPPORTED_MEDIA_TYPE = _define("/problems/unsupported-media-type", "Unsupported media type", 415, "body is not JSON")
RANGE_NOT_SATISFIABLE = _define("/problems/range-not-satisfiable", "Range not satisfiable", 416,
                                "a result's `Range` starts past its end; `Content-Range: bytes */<size>`")
MISDIRECTED = _define("/problems/misdirected-request", "Misdirected request", 421,
                      "a Host this loopback-bound gateway does not serve (DNS rebinding)")
UNPROCESSABLE = _define("/problems/unprocessable", "Unprocessable request", 422)
IDEMPOTENCY_KEY_MISMATCH = _define("/problems/idempotency-key-mismatch", "Idempotency-Key reused", 422,
                                   "the key was used with another request")
RATE_LIMITED = _define("/problems/rate-limited", "Too many requests", 429, "with Retry-After")
TOO_MANY_STREAMS = _define("/problems/too-many-streams", "Too many open streams", 429, "with Retry-After")
HEADERS_TOO_LARGE = _define("/problems/headers-too-large", "Request header fields too large", 431)
INTERNAL = _define("/problems/internal", "Internal server error", 500)
UNAVAILABLE = _define("/problems/unavailable", "Service unavailable", 503, "with Retry-After")
OVERLOADED = _define("/problems/overloaded", "Overloaded", 503, "the backlog is too old; with Retry-After")
NOT_READY = _define("/problems/not-ready", "Not ready", 503)
STORE_UNAVAILABLE = _define("/problems/store-unavailable", "Store unavailable", 503, "with Retry-After")
GENERIC = _define("/problems/error", "Error")  # a framework error of a status no type above names

# ----- a failed job's `error` --------------------------------------------------------------

WORKER_LOST = _define("/problems/worker-lost", "Worker lost")
DEADLINE_EXCEEDED = _define("/problems/deadline-exceeded", "Deadline exceeded")
JOB_FAILED = _define("/problems/job-failed", "The job failed")
REPORT_RENDER_FAILED = _define("/problems/report-render-failed", "Report rendering failed")
OUTPUT_TOO_LARGE = _define("/problems/output-too-large", "Output too large")

PROBLEM_TYPES: tuple[ProblemType, ...] = tuple(_DEFINED)


def types_for_status(status: int) -> list[ProblemType]:
    """Every type an answer with this status can carry."""
    return [problem_type for problem_type in PROBLEM_TYPES if problem_type.status == status]
