"""The wire shapes a client reads, as msgspec Structs (SPEC §4, §7, §8, §12).

These mirror the server's ``schemas`` package field for field but are the client's own
(see client/README.md for why): they accept unknown fields, since the contract allows
the server to add fields, and they carry nothing the client does not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class FieldError(msgspec.Struct, kw_only=True):
    field: str
    message: str


class Problem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An RFC 9457 problem: a job's ``error``, or the body of any 4xx/5xx answer."""

    type: str = "about:blank"
    title: str = ""
    status: int | None = None
    detail: str | None = None
    errors: list[FieldError] | None = None


class JobLinks(msgspec.Struct, kw_only=True):
    self: str
    events: str
    output: str | None = None  # the signed streamed-output URL (SPEC §8); None from an older server
    result: str | None = None


class JobStatus(msgspec.Struct, kw_only=True):
    """The status resource ``GET /jobs/{id}``: the source of truth about a job."""

    id: str
    kind: str
    state: JobState
    progress: int | None
    version: int
    attempt: int
    created_at: str
    updated_at: str
    expires_at: str | None
    cancel_requested: bool
    result: str | None
    error: Problem | None
    links: JobLinks
    trace_id: str | None = None  # the job's W3C trace id: its spans in your tracing backend
    # While queued: "tenant-max-running" (your tenant runs its max_running already) or
    # "waiting-for-slot" (its turn for a worker slot comes).
    queued_reason: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


class JobList(msgspec.Struct, kw_only=True):
    items: list[JobStatus]
    next_cursor: str | None


class JobEvent(msgspec.Struct, kw_only=True, frozen=True):
    """One server-sent event of a job stream: ``id`` is the job version as a string."""

    id: str | None
    type: str
    data: JobStatus


class OutputChunk(msgspec.Struct, kw_only=True, frozen=True):
    """One chunk of a job's streamed output (SPEC §8): ``n`` is 1, 2, 3… per job, ``data``
    the JSON value the handler emitted."""

    n: int
    data: Any


TEST_EVENT_TYPE = "webhook.test"


class WebhookTestData(msgspec.Struct, kw_only=True):
    """``data`` of a ``webhook.test`` delivery (``send_test_event``, the portal's test button)."""

    endpoint_id: str
    message: str


class WebhookEvent(msgspec.Struct, kw_only=True):
    """The payload of a verified webhook delivery (Standard Webhooks, SPEC §7): ``data`` is the
    job's status, or for ``type == "webhook.test"`` a ``WebhookTestData``."""

    type: str
    timestamp: str
    data: JobStatus | WebhookTestData


class _WebhookEnvelope(msgspec.Struct, kw_only=True):
    type: str
    timestamp: str
    data: msgspec.Raw


class Result(msgspec.Struct, kw_only=True):
    """A finished job's result, fetched by ``wait(..., follow=True)``."""

    status: JobStatus
    content: bytes
    media_type: str
    filename: str | None


class Download(msgspec.Struct, kw_only=True):
    """Where ``download`` wrote a result."""

    status: JobStatus
    path: Path
    media_type: str
    size: int


# ----- webhooks (SPEC §7) ------------------------------------------------------------------


class LastDelivery(msgspec.Struct, kw_only=True):
    """An endpoint's newest delivery; ``status_code`` and ``error`` of its latest attempt."""

    id: str
    type: str
    status: str
    created_at: str
    status_code: int | None
    error: str | None


class EndpointHealth(msgspec.Struct, kw_only=True):
    """How an endpoint is doing over its newest ``window`` deliveries."""

    window: int
    delivered: int
    failed: int
    success_rate: float | None
    last_delivery: LastDelivery | None


class Endpoint(msgspec.Struct, kw_only=True):
    """A webhook endpoint: where the tenant's job events are delivered, signed."""

    id: str
    url: str
    event_types: list[str]
    kinds: list[str] | None
    signature: str
    status: str
    created_at: str
    health: EndpointHealth | None = None


class CreatedEndpoint(Endpoint, kw_only=True):
    """The answer to creating an endpoint: the only time its secret (or public key) is shown."""

    secret: str | None = None
    public_key: str | None = None


class EndpointList(msgspec.Struct, kw_only=True):
    items: list[Endpoint]
    next_cursor: str | None


class SigningSecret(msgspec.Struct, kw_only=True):
    """``secret`` (``whsec_…``) for HMAC, or ``public_key`` (``whpk_…``) for Ed25519."""

    secret: str | None = None
    public_key: str | None = None


class Attempt(msgspec.Struct, kw_only=True):
    at: str
    status_code: int | None
    latency_ms: int | None
    error: str | None
    response: str | None  # the first KiB of the receiver's answer


class Delivery(msgspec.Struct, kw_only=True):
    """One event to one endpoint, with its attempts and the payload exactly as signed."""

    id: str
    event_id: str
    type: str
    job_id: str | None  # None for a webhook.test event
    version: int | None
    status: str
    next_attempt_at: str | None
    created_at: str
    attempts: list[Attempt]
    payload: str | None


class DeliveryList(msgspec.Struct, kw_only=True):
    items: list[Delivery]
    next_cursor: str | None


class PortalLink(msgspec.Struct, kw_only=True):
    """A signed ``/portal`` URL (path-absolute): the tenant's webhooks without a key."""

    url: str
    expires_in: int


class Recovered(msgspec.Struct, kw_only=True):
    count: int


# ----- tenants and keys: the admin API (SPEC §12) --------------------------------------------


class TenantLimits(msgspec.Struct, kw_only=True):
    """A tenant's limits (SPEC §13): job starts per second, running jobs (0: no cap),
    webhook endpoints and held connections. A limit never set shows the deployment's default."""

    rate_limit: float
    max_running: int
    max_endpoints: int
    max_streams: int


class Tenant(msgspec.Struct, kw_only=True):
    """A tenant. ``source`` is ``"api"`` (made through ``/admin``) or ``"env"`` (from
    ``HERALD_API_KEYS``: configuration, whose keys the API cannot revoke)."""

    id: str
    created_at: str | None  # None for a tenant of HERALD_API_KEYS never changed over the API
    disabled: bool
    limits: TenantLimits
    source: str = "api"


class TenantList(msgspec.Struct, kw_only=True):
    items: list[Tenant]
    next_cursor: str | None = None


class ApiKey(msgspec.Struct, kw_only=True):
    """A tenant's key as listed: never the key itself. ``last_used_at`` is to the minute;
    ``source`` is ``"env"`` for a key of ``HERALD_API_KEYS``."""

    id: str
    tenant: str
    name: str
    scopes: list[str]
    created_at: str | None
    expires_at: str | None
    last_used_at: str | None
    source: str = "api"


class CreatedKey(ApiKey, kw_only=True):
    """The answer to creating a key: the only time the key (``hk_…``) is shown."""

    key: str


class KeyList(msgspec.Struct, kw_only=True):
    """A tenant's keys: one page, all of them (SPEC §12)."""

    items: list[ApiKey]


class AuditEntry(msgspec.Struct, kw_only=True):
    """One change made through the admin API: ``tenant.created``, ``tenant.updated``,
    ``tenant.disabled``, ``key.created``, ``key.revoked``. Never a key or a secret."""

    id: str
    at: str
    action: str
    tenant: str | None
    key_id: str | None
    detail: dict[str, Any] = msgspec.field(default_factory=dict)


class AuditList(msgspec.Struct, kw_only=True):
    items: list[AuditEntry]
    next_cursor: str | None = None


status_decoder = msgspec.json.Decoder(JobStatus)
problem_decoder = msgspec.json.Decoder(Problem)
_envelope_decoder = msgspec.json.Decoder(_WebhookEnvelope)
_test_data_decoder = msgspec.json.Decoder(WebhookTestData)


def decode_webhook(raw: bytes) -> WebhookEvent:
    """A delivery's body, its ``data`` typed by its ``type`` (two Structs cannot share one
    untagged union in msgspec); raises ``msgspec.DecodeError``."""
    envelope = _envelope_decoder.decode(raw)
    decoder = _test_data_decoder if envelope.type == TEST_EVENT_TYPE else status_decoder
    return WebhookEvent(type=envelope.type, timestamp=envelope.timestamp, data=decoder.decode(envelope.data))
