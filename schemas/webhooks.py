"""Webhooks (SPEC §7): endpoint bodies and views, deliveries, attempts, and the payload sent."""

from __future__ import annotations

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


class Endpoint(msgspec.Struct, kw_only=True):
    id: str
    url: str
    event_types: list[str]
    kinds: list[str] | None
    signature: SignatureScheme
    status: EndpointStatus
    created_at: str


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
    job_id: str
    version: int
    status: DeliveryStatus
    next_attempt_at: str | None
    created_at: str
    attempts: list[Attempt]


class DeliveryList(msgspec.Struct, kw_only=True):
    items: list[Delivery]
    next_cursor: str | None


class WebhookPayload(msgspec.Struct, kw_only=True):
    """The body of every delivery: ``data`` is the status object exactly as committed."""

    type: str
    timestamp: str
    data: msgspec.Raw
