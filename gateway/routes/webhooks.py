"""Webhook endpoints, their delivery log and the tenant's callback secret (SPEC §7).

Bodies are read and checked here field by field (like start requests), so every invalid
body is answered the same way: ``400 /problems/invalid-request`` naming each bad field.
Another tenant's endpoint or delivery is answered exactly like a missing one: ``404``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, delete, get, patch, post
from litestar.params import Parameter

from gateway.auth import require_tenant
from gateway.bodies import read_body, url_errors
from gateway.cursors import decode_position, decode_seq, encode_position, encode_seq
from gateway.ids import is_uuid
from gateway.openapi import problems, with_body
from gateway.problems import EndpointDisabled, InvalidRequest, NotFound
from gateway.services import services
from herald.timefmt import rfc3339
from notifier.signing import SigningKey
from herald.deliveries import AttemptRow, DeliveryRow, EndpointRow
from herald.storage.ports import WebhookStore
from schemas import FieldError
from schemas.webhooks import (
    DEFAULT_EVENT_TYPES,
    DELIVERY_STATUSES,
    Attempt,
    CreatedEndpoint,
    Delivery,
    DeliveryList,
    Endpoint,
    EndpointCreate,
    EndpointList,
    EndpointPatch,
    SigningSecret,
)
from herald.kinds import declared_kinds

B = TypeVar("B", EndpointCreate, EndpointPatch)

DEFAULT_LIMIT = 20
MAX_LIMIT = 100


def _webhooks(request: Request) -> WebhookStore:
    return services(request).storage.webhooks


# ----- reading requests ---------------------------------------------------------------


async def _body(request: Request, body_type: type[B]) -> B:
    body, _document = await read_body(request, body_type)
    return body


def _kind_errors(kinds: list[str] | None) -> list[FieldError]:
    known = declared_kinds()
    unknown = sorted({k for k in kinds or () if k not in known})
    if unknown:
        message = f"unknown kind(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        return [FieldError(field="kinds", message=message)]
    return []


async def _url_errors(request: Request, url: str) -> list[FieldError]:
    return await url_errors(services(request).settings, "url", url)


def _unique(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


# Query parameters are declared as plain strings (for the OpenAPI document) and checked
# here, so that a bad one is answered like a bad body field.
Limit = Annotated[str | None, Parameter(query="limit", description=f"1..{MAX_LIMIT}, default {DEFAULT_LIMIT}")]
Cursor = Annotated[str | None, Parameter(query="cursor", description="next_cursor of the previous page")]
StatusFilter = Annotated[str | None, Parameter(query="status", description=" or ".join(DELIVERY_STATUSES))]


NO_ENDPOINT = "no such webhook endpoint"


def _limit(raw: str | None, errors: list[FieldError]) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        errors.append(FieldError(field="limit", message=f"must be an integer from 1 to {MAX_LIMIT}"))
        return DEFAULT_LIMIT
    return int(raw)


async def _endpoint(request: Request, tenant: str, endpoint_id: str) -> EndpointRow:
    try:
        uuid.UUID(endpoint_id)
    except ValueError:
        raise NotFound(NO_ENDPOINT) from None
    endpoint = await _webhooks(request).get_endpoint(tenant, endpoint_id)
    if endpoint is None:
        raise NotFound(NO_ENDPOINT)
    return endpoint


# ----- views ----------------------------------------------------------------------------


def endpoint_view(row: EndpointRow) -> Endpoint:
    return Endpoint(
        id=row.id,
        url=row.url,
        event_types=list(row.event_types),
        kinds=list(row.kinds) if row.kinds is not None else None,
        signature=row.signature,  # type: ignore[arg-type]
        status=row.status,  # type: ignore[arg-type]
        created_at=rfc3339(row.created_at) or "",
    )


def secret_view(key: SigningKey) -> SigningSecret:
    return SigningSecret(secret=key.shown_secret, public_key=key.shown_public_key)


def _attempt_view(row: AttemptRow) -> Attempt:
    return Attempt(
        at=rfc3339(row.at) or "",
        status_code=row.status_code,
        latency_ms=round(row.latency_ms) if row.latency_ms is not None else None,
        error=row.error,
        response=bytes(row.response).decode("utf-8", errors="replace") if row.response else None,
    )


def delivery_view(row: DeliveryRow, attempts: list[AttemptRow]) -> Delivery:
    return Delivery(
        id=row.id,
        event_id=row.event_id,
        type=row.type,
        job_id=row.job_id,
        version=row.version,
        status=row.status,  # type: ignore[arg-type]
        next_attempt_at=rfc3339(row.next_attempt_at) if row.status == "pending" else None,
        created_at=rfc3339(row.created_at) or "",
        attempts=[_attempt_view(a) for a in attempts],
    )


# ----- the API --------------------------------------------------------------------------


class WebhooksController(Controller):
    path = "/webhooks"
    tags = ["webhooks"]

    @post("/", operation_id="create_webhook", status_code=201, summary="Register a webhook endpoint",
          operation_class=with_body(EndpointCreate, "The endpoint"), responses=problems(400, 401, 413, 415))
    async def create(self, request: Request) -> Response[CreatedEndpoint]:
        """201 with the endpoint and, this once, its ``secret`` (HMAC) or ``public_key`` (Ed25519)."""
        svc = services(request)
        tenant = require_tenant(request, svc.settings)
        body = await _body(request, EndpointCreate)
        errors = _kind_errors(body.kinds) + await _url_errors(request, body.url)
        if errors:
            raise InvalidRequest(errors)
        row, key = await _webhooks(request).create_endpoint(
            tenant,
            url=body.url,
            event_types=_unique(list(body.event_types)) if body.event_types else list(DEFAULT_EVENT_TYPES),
            kinds=_unique(body.kinds) if body.kinds is not None else None,
            signature=body.signature,
        )
        created = CreatedEndpoint(**msgspec.structs.asdict(endpoint_view(row)), secret=key.shown_secret,
                                  public_key=key.shown_public_key)
        return Response(created, status_code=201, headers={"Location": f"/webhooks/{row.id}",
                                                           "Cache-Control": "no-store"})

    @get("/", operation_id="list_webhooks", summary="The tenant's webhook endpoints, newest first",
         responses=problems(400, 401))
    async def list_endpoints(self, request: Request, limit: Limit = None, cursor: Cursor = None) -> EndpointList:
        tenant = require_tenant(request, services(request).settings)
        errors: list[FieldError] = []
        size = _limit(limit, errors)
        if errors:
            raise InvalidRequest(errors)
        before = decode_position(cursor) if cursor is not None else None
        rows = await _webhooks(request).list_endpoints(tenant, before=before, limit=size + 1)
        page = rows[:size]
        more = len(rows) > size
        return EndpointList(
            items=[endpoint_view(r) for r in page],
            next_cursor=encode_position(page[-1].created_at, page[-1].id) if more else None,
        )

    @get("/callback-secret", operation_id="get_callback_secret",
         summary="The secret that signs deliveries to jobs' callback_url", responses=problems(401))
    async def callback_secret(self, request: Request) -> SigningSecret:
        tenant = require_tenant(request, services(request).settings)
        key = await _webhooks(request).callback_key(tenant)
        return secret_view(key)

    @post("/callback-secret/rotate", operation_id="rotate_callback_secret", status_code=200,
          summary="A new callback secret; the old one keeps signing for 24 h", responses=problems(401))
    async def rotate_callback_secret(self, request: Request) -> SigningSecret:
        tenant = require_tenant(request, services(request).settings)
        key = await _webhooks(request).rotate_callback_key(tenant)
        return secret_view(key)

    @get("/{endpoint_id:str}", operation_id="get_webhook", summary="One webhook endpoint",
         responses=problems(401, 404))
    async def get_endpoint(self, request: Request, endpoint_id: str) -> Endpoint:
        tenant = require_tenant(request, services(request).settings)
        return endpoint_view(await _endpoint(request, tenant, endpoint_id))

    @patch("/{endpoint_id:str}", operation_id="update_webhook",
           summary="Change url, event_types, kinds or status (enabled/disabled)",
           operation_class=with_body(EndpointPatch, "The fields to change"), responses=problems(400, 401, 404, 415))
    async def update(self, request: Request, endpoint_id: str) -> Endpoint:
        tenant = require_tenant(request, services(request).settings)
        await _endpoint(request, tenant, endpoint_id)
        body = await _body(request, EndpointPatch)
        changes: dict[str, Any] = {}
        errors: list[FieldError] = []
        if body.url is not msgspec.UNSET:
            errors += await _url_errors(request, body.url)
            changes["url"] = body.url
        if body.event_types is not msgspec.UNSET:
            changes["event_types"] = _unique(list(body.event_types))
        if body.kinds is not msgspec.UNSET:
            errors += _kind_errors(body.kinds)
            changes["kinds"] = _unique(body.kinds) if body.kinds is not None else None
        if body.status is not msgspec.UNSET:
            changes["status"] = body.status
        if errors:
            raise InvalidRequest(errors)
        row = await _webhooks(request).update_endpoint(tenant, endpoint_id, changes)
        if row is None:  # deleted meanwhile
            raise NotFound(NO_ENDPOINT)
        return endpoint_view(row)

    @delete("/{endpoint_id:str}", operation_id="delete_webhook", status_code=204,
            summary="Delete the endpoint with its delivery log", responses=problems(401, 404))
    async def remove(self, request: Request, endpoint_id: str) -> None:
        tenant = require_tenant(request, services(request).settings)
        await _endpoint(request, tenant, endpoint_id)
        if not await _webhooks(request).delete_endpoint(tenant, endpoint_id):
            raise NotFound(NO_ENDPOINT)

    @post("/{endpoint_id:str}/rotate-secret", operation_id="rotate_webhook_secret", status_code=200,
          summary="A new secret (or key pair); the old one keeps signing for 24 h", responses=problems(401, 404))
    async def rotate(self, request: Request, endpoint_id: str) -> SigningSecret:
        tenant = require_tenant(request, services(request).settings)
        await _endpoint(request, tenant, endpoint_id)
        key = await _webhooks(request).rotate_endpoint_key(tenant, endpoint_id)
        if key is None:
            raise NotFound(NO_ENDPOINT)
        return secret_view(key)

    @get("/{endpoint_id:str}/deliveries", operation_id="list_webhook_deliveries",
         summary="The endpoint's deliveries with their attempts, newest first (?status=)",
         responses=problems(400, 401, 404))
    async def deliveries(
        self,
        request: Request,
        endpoint_id: str,
        status: StatusFilter = None,
        limit: Limit = None,
        cursor: Cursor = None,
    ) -> DeliveryList:
        tenant = require_tenant(request, services(request).settings)
        endpoint = await _endpoint(request, tenant, endpoint_id)
        errors: list[FieldError] = []
        size = _limit(limit, errors)
        if status is not None and status not in DELIVERY_STATUSES:
            errors.append(FieldError(field="status", message=f"must be one of {', '.join(DELIVERY_STATUSES)}"))
        if errors:
            raise InvalidRequest(errors)
        before = decode_seq(cursor) if cursor is not None else None
        store = _webhooks(request)
        rows = await store.list_deliveries(endpoint.id, status=status, before_seq=before, limit=size + 1)
        page = rows[:size]
        attempts = await store.attempts([r.id for r in page])
        return DeliveryList(
            items=[delivery_view(r, attempts[r.id]) for r in page],
            next_cursor=encode_seq(page[-1].seq) if len(rows) > size else None,
        )

    @post("/{endpoint_id:str}/deliveries/{delivery_id:str}/retry", operation_id="retry_webhook_delivery",
          status_code=202, summary="Send the delivery again now, with the same webhook-id, whatever its status",
          responses=problems(401, 404, 409))
    async def retry(self, request: Request, endpoint_id: str, delivery_id: str) -> Response[Delivery]:
        tenant = require_tenant(request, services(request).settings)
        endpoint = await _endpoint(request, tenant, endpoint_id)
        store = _webhooks(request)
        if not is_uuid(delivery_id) or await store.get_delivery(endpoint.id, delivery_id) is None:
            raise NotFound("no such delivery")
        if endpoint.status != "enabled":
            raise EndpointDisabled("enable the endpoint (PATCH status: enabled) before retrying its deliveries")
        row = await store.retry_now(endpoint.id, delivery_id)
        if row is None:
            raise NotFound("no such delivery")
        return Response(delivery_view(row, (await store.attempts([row.id]))[row.id]), status_code=202,
                        headers={"Cache-Control": "no-store"})
