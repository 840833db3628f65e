"""Webhooks (SPEC §7): endpoint bodies and views, deliveries, attempts, and the payload sent."""

from __future__ import annotations

from datetime import datetime
from typing import get_args, Annotated, Literal

import msgspec

from schemas.base import Base
from schemas.jobs import EventType
from schemas.problems import FieldError

SignatureScheme = Literal["hmac-sha256", "ed25519"]
EndpointStatus = Literal["enabled", "disabled"]
DeliveryStatus = Literal["pending", "delivered", "failed", "superseded"]

ALL_EVENT_TYPES: tuple[str, ...] = get_args(EventType)
# job.progress is opt-in: a fast job would flood an endpoint that did not ask for it.
DEFAULT_EVENT_TYPES: tuple[str, ...] = tuple(t for t in ALL_EVENT_TYPES if t != "job.progress")
DELIVERY_STATUSES: tuple[str, ...] = get_args(DeliveryStatus)
# The type of the event POST /webhooks/{id}/test sends. Not an EventType: it cannot be
# subscribed to and is never delivered otherwise.
TEST_EVENT_TYPE = "webhook.test"

WebhookUrl = Annotated[str, msgspec.Meta(min_length=8, max_length=2048, description="https URL receiving events")]
EventTypes = Annotated[list[EventType], msgspec.Meta(min_length=1, max_length=len(ALL_EVENT_TYPES))]
KindName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Kinds = Annotated[list[KindName], msgspec.Meta(min_length=1, max_length=100, description="null: every kind")]


class _Body(Base, kw_only=True):
    def cross_field_errors(self) -> list[FieldError]:
        return []


class EndpointCreate(_Body, kw_only=True):
    """``POST /webhooks``."""

    url: WebhookUrl
    event_types: EventTypes | None = None  # None: every type but job.progress
    kinds: Kinds | None = None
    signature: SignatureScheme = "hmac-sha256"


class EndpointPatch(_Body, kw_only=True):
    """``PATCH /webhooks/{id}``: only the fields present change (``kinds: null`` means every kind)."""

    url: WebhookUrl | msgspec.UnsetType = msgspec.UNSET
    event_types: EventTypes | msgspec.UnsetType = msgspec.UNSET
    kinds: Kinds | None | msgspec.UnsetType = msgspec.UNSET
    status: EndpointStatus | msgspec.UnsetType = msgspec.UNSET


class LastDelivery(msgspec.Struct, kw_only=True):
    """The endpoint's newest delivery and what its latest attempt came to."""

    id: str
    type: str
    status: DeliveryStatus
    created_at: str
    status_code: int | None  # of its latest attempt; None: not attempted yet, or no answer
    error: str | None


class EndpointHealth(msgspec.Struct, kw_only=True):
    """How an endpoint is doing, over its newest ``window`` deliveries."""

    window: int
    delivered: int
    failed: int
    success_rate: float | None  # delivered / (delivered + failed); None while none has ended
    last_delivery: LastDelivery | None


class Endpoint(msgspec.Struct, kw_only=True):
    id: str
    url: str
    event_types: list[str]
    kinds: list[str] | None
    signature: SignatureScheme
    status: EndpointStatus
    created_at: str
    health: EndpointHealth | None = None  # left out of the answer to POST /webhooks


class CreatedEndpoint(Endpoint, kw_only=True, omit_defaults=True):
    """The answer to ``POST /webhooks``: the only time the secret (or public key) is shown."""

    secret: str | None = None
    public_key: str | None = None


class EndpointList(msgspec.Struct, kw_only=True):
    items: list[Endpoint]
    next_cursor: str | None


class SigningSecret(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``{"secret": "whsec_…"}`` or, for an Ed25519 endpoint, ``{"public_key": "whpk_…"}``."""

    secret: str | None = None
    public_key: str | None = None


class Attempt(msgspec.Struct, kw_only=True):
    at: str
    status_code: int | None
    latency_ms: int | None
    error: str | None
    response: str | None  # the first KiB of the answer's body


class Delivery(msgspec.Struct, kw_only=True):
    id: str
    event_id: str
    type: str
    job_id: str | None  # None for a webhook.test event
    version: int | None  # the job's version the event carries; None for a webhook.test event
    status: DeliveryStatus
    next_attempt_at: str | None
    created_at: str
    attempts: list[Attempt]
    payload: str | None  # the body exactly as signed and sent (None once pruned)


class RecoverRequest(_Body, kw_only=True):
    """``POST /webhooks/{id}/recover``: resend every failed delivery created since then."""

    since: Annotated[datetime, msgspec.Meta(tz=True, description="RFC 3339 time with an offset, e.g. 2026-01-01T00:00:00Z")]


class Recovered(msgspec.Struct, kw_only=True):
    count: int  # failed deliveries made due again


class WebhookTestData(msgspec.Struct, kw_only=True):
    """``data`` of a ``webhook.test`` event."""

    endpoint_id: str
    message: str


class PortalLink(msgspec.Struct, kw_only=True):
    """``POST /portal/link``: a signed ``/portal`` URL to open within ``expires_in`` seconds."""

    url: str
    expires_in: int


class PortalSessionRequest(_Body, kw_only=True):
    """``POST /portal/session``: the query of a portal link, exchanged for a session token."""

    tenant: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9-]+$(?!\n)")]  # the id of the key that made the link
    exp: Annotated[str, msgspec.Meta(min_length=1, max_length=12)]
    sig: Annotated[str, msgspec.Meta(min_length=1, max_length=100)]


class PortalSession(msgspec.Struct, kw_only=True):
    """A bearer token for the tenant's ``/webhooks`` routes only, valid ``expires_in`` seconds."""

    token: str
    tenant: str
    expires_in: int


class DeliveriesChanged(msgspec.Struct, kw_only=True):
    """``data`` of an ``event: deliveries`` on ``GET /webhooks/events``."""

    endpoint_id: str | None  # None: any endpoint of the tenant may have changed (re-read them all)


class DeliveryList(msgspec.Struct, kw_only=True):
    items: list[Delivery]
    next_cursor: str | None


class WebhookPayload(msgspec.Struct, kw_only=True):
    """The body of every delivery: ``data`` is the status object exactly as committed."""

    type: str
    timestamp: str
    data: msgspec.Raw
