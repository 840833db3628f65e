"""Webhook endpoints, their delivery log and the tenant's callback secret (SPEC §7).

Bodies are read and checked here field by field (like start requests), so every invalid
body is answered the same way: ``400 /problems/invalid-request`` naming each bad field.
Another tenant's endpoint or delivery is answered exactly like a missing one: ``404``.

Every route here takes the tenant's API key or a portal session (``gateway.auth``): the
webhook portal (``/portal``) does all it does through these routes. ``GET /webhooks/events``
tells a watching page when to read them again.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeVar
from urllib.parse import quote

import msgspec
from litestar import Controller, Request, Response, delete, get, patch, post
from litestar.params import FromPath, QueryParameter

from gateway.auth import note_stream_owner, require_webhook_tenant
from gateway.bodies import read_body, url_errors
from gateway.cursors import decode_position, encode_position, open_seq, seal_seq
from gateway.ids import is_uuid
from gateway.openapi import problems, with_body
from gateway.problems import (
    EVENT_STREAM_OPT,
    EndpointDisabled,
    InvalidRequest,
    InvalidSignature,
    LimitReached,
    NotFound,
    RateLimited,
)
from gateway.render import NO_STORE
from gateway.services import Services, services
from gateway.sse import KEEPALIVE_FRAME, KEEPALIVE_S, RETRY_FRAME, EventStream, frame
from herald.timefmt import rfc3339
from herald.webhook_signing import SigningKey
from herald.deliveries import (
    HEALTH_WINDOW,
    TEST_EVENT_TYPE,
    TEST_JOB_PREFIX,
    AttemptRow,
    DeliveryRow,
    EndpointRow,
    HealthRow,
    EndpointLimitReached,
    TestEventsLimited,
    new_test_event,
)
from herald.storage.ports import WebhookStore
from schemas import FieldError
from schemas.events import EventLink
from schemas.webhooks import (
    DEFAULT_EVENT_TYPES,
    DELIVERY_STATUSES,
    Attempt,
    CreatedEndpoint,
    DeliveriesChanged,
    Delivery,
    DeliveryList,
    Endpoint,
    EndpointCreate,
    EndpointHealth,
    EndpointList,
    EndpointPatch,
    LastDelivery,
    RecoverRequest,
    Recovered,
    SigningSecret,
    WebhookPayload,
    WebhookTestData,
)
from herald.kinds import declared_kinds

B = TypeVar("B", EndpointCreate, EndpointPatch, RecoverRequest)

WEBHOOK_EVENTS_PURPOSE = "webhook-events"
DELIVERIES_EVENT = "deliveries"
TEST_MESSAGE = ("A test event from Herald: this endpoint receives signed deliveries. "
                "Verify its signature as you verify every other event.")
_encoder = msgspec.json.Encoder()

DEFAULT_LIMIT = 20
MAX_LIMIT = 100


def _webhooks(request: Request) -> WebhookStore:
    return services(request).storage.webhooks


def _tenant(request: Request) -> str:
    """The API key's tenant, or a portal session's (these routes are the portal's scope)."""
    svc = services(request)
    return require_webhook_tenant(request, svc)


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
    svc = services(request)
    return await url_errors(svc.settings, svc.resolver, "url", url)


def _unique(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


# Query parameters are declared as plain strings (for the OpenAPI document) and checked
# here, so that a bad one is answered like a bad body field.
Limit = Annotated[str | None, QueryParameter(name="limit", description=f"1..{MAX_LIMIT}, default {DEFAULT_LIMIT}")]
Cursor = Annotated[str | None, QueryParameter(name="cursor", description="next_cursor of the previous page")]
StatusFilter = Annotated[str | None, QueryParameter(name="status", description=" or ".join(DELIVERY_STATUSES))]


NO_ENDPOINT = "no such webhook endpoint"


def _limit(raw: str | None, errors: list[FieldError]) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    # isascii first: str.isdigit() accepts '²', which int() refuses, and '٣', which it reads as 3.
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 4 or not 1 <= int(raw) <= MAX_LIMIT:
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


def endpoint_view(row: EndpointRow, health: EndpointHealth | None = None) -> Endpoint:
    return Endpoint(
        id=row.id,
        url=row.url,
        event_types=list(row.event_types),
        kinds=list(row.kinds) if row.kinds is not None else None,
        signature=row.signature,  # type: ignore[arg-type]
        status=row.status,  # type: ignore[arg-type]
        created_at=rfc3339(row.created_at) or "",
        health=health,
    )


async def _health(store: WebhookStore, endpoint_ids: list[str]) -> dict[str, EndpointHealth]:
    """Success rate over the newest deliveries and the last one's outcome, for a page of endpoints."""
    rows: dict[str, HealthRow] = await store.endpoint_health(endpoint_ids, HEALTH_WINDOW)
    last_ids = [h.last.id for h in rows.values() if h.last is not None]
    attempts = await store.attempts(last_ids) if last_ids else {}
    found: dict[str, EndpointHealth] = {}
    for endpoint_id in endpoint_ids:
        row = rows.get(endpoint_id, HealthRow(delivered=0, failed=0, last=None))
        ended = row.delivered + row.failed
        last = None
        if row.last is not None:
            tried = attempts.get(row.last.id) or []
            last = LastDelivery(
                id=row.last.id, type=row.last.type, status=row.last.status,  # type: ignore[arg-type]
                created_at=rfc3339(row.last.created_at) or "",
                status_code=tried[-1].status_code if tried else None,
                error=tried[-1].error if tried else None,
            )
        found[endpoint_id] = EndpointHealth(
            window=HEALTH_WINDOW, delivered=row.delivered, failed=row.failed,
            success_rate=round(row.delivered / ended, 4) if ended else None, last_delivery=last,
        )
    return found


async def _endpoint_views(request: Request, rows: list[EndpointRow]) -> list[Endpoint]:
    health = await _health(_webhooks(request), [r.id for r in rows])
    return [endpoint_view(r, health[r.id]) for r in rows]


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


def delivery_view(row: DeliveryRow, attempts: list[AttemptRow], payload: bytes | None) -> Delivery:
    is_test = row.type == TEST_EVENT_TYPE and row.job_id.startswith(TEST_JOB_PREFIX)
    return Delivery(
        id=row.id,
        event_id=row.event_id,
        type=row.type,
        job_id=None if is_test else row.job_id,
        version=None if is_test else row.version,
        status=row.status,  # type: ignore[arg-type]
        next_attempt_at=rfc3339(row.next_attempt_at) if row.status == "pending" else None,
        created_at=rfc3339(row.created_at) or "",
        attempts=[_attempt_view(a) for a in attempts],
        payload=payload.decode("utf-8", errors="replace") if payload is not None else None,
    )


def _deliveries_scope(endpoint_id: str) -> str:
    """What a deliveries cursor is bound to: it pages this endpoint's deliveries only."""
    return f"webhook_deliveries|{endpoint_id}"


async def _delivery_views(store: WebhookStore, rows: list[DeliveryRow]) -> list[Delivery]:
    attempts = await store.attempts([r.id for r in rows])
    bodies = await store.messages(sorted({r.event_id for r in rows}))
    return [delivery_view(r, attempts[r.id], bodies.get(r.event_id)) for r in rows]


async def _changed(request: Request, tenant: str, endpoint_id: str | None) -> None:
    """Tell the portals watching this tenant (on any gateway) that deliveries changed."""
    await services(request).watch.announce(tenant, endpoint_id)


def _webhook_events_tenant(request: Request, svc: Services) -> str:
    query = request.query_params
    if "sig" in query or "exp" in query:
        tenant = query.get("tenant") or ""
        if len(tenant) > 64 or not svc.signer.verify("/webhooks/events", WEBHOOK_EVENTS_PURPOSE, query.get("exp"),
                                                     query.get("sig"), extra=tenant):
            raise InvalidSignature("this signed stream URL is not valid; ask POST /webhooks/events/link for a fresh one")
        note_stream_owner(request, svc, tenant)
        return tenant
    return require_webhook_tenant(request, svc)


def _notice_frame(endpoint_id: str | None) -> bytes:
    return frame(None, DELIVERIES_EVENT, _encoder.encode(DeliveriesChanged(endpoint_id=endpoint_id)))


async def _notice_stream(svc: Services, tenant: str) -> AsyncIterator[bytes]:
    watcher = svc.watch.watch(tenant)
    svc.metrics.sse_streams.inc()
    try:
        # Watching first, then "read everything now": whatever changes after this point is
        # noticed, whatever changed before it is in that read. Nothing is replayed.
        yield RETRY_FRAME + _notice_frame(None)
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    await watcher.wake.wait()
            except TimeoutError:
                yield KEEPALIVE_FRAME
                continue
            yield b"".join(_notice_frame(endpoint_id) for endpoint_id in watcher.take())
    finally:
        svc.metrics.sse_streams.dec()
        svc.watch.unwatch(watcher)


# ----- the API --------------------------------------------------------------------------


class WebhooksController(Controller):
    path = "/webhooks"
    tags = ["webhooks"]

    @post("/", operation_id="create_webhook", status_code=201, summary="Register a webhook endpoint",
          operation_class=with_body(EndpointCreate, "The endpoint"), responses=problems(400, 401, 409, 413, 415))
    async def create(self, request: Request) -> Response[CreatedEndpoint]:
        """201 with the endpoint and, this once, its ``secret`` (HMAC) or ``public_key`` (Ed25519)."""
        tenant = _tenant(request)
        body = await _body(request, EndpointCreate)
        errors = _kind_errors(body.kinds) + await _url_errors(request, body.url)
        if errors:
            raise InvalidRequest(errors)
        try:
            row, key = await _webhooks(request).create_endpoint(
                tenant,
                url=body.url,
                event_types=_unique(list(body.event_types)) if body.event_types else list(DEFAULT_EVENT_TYPES),
                kinds=_unique(body.kinds) if body.kinds is not None else None,
                signature=body.signature,
                max_endpoints=services(request).limits.limits(tenant).max_endpoints,
            )
        except EndpointLimitReached as exc:
            raise LimitReached(f"{exc}; delete one (DELETE /webhooks/{{id}}) or ask the operator for more") from None
        created = CreatedEndpoint(**msgspec.structs.asdict(endpoint_view(row)), secret=key.shown_secret,
                                  public_key=key.shown_public_key)
        return Response(created, status_code=201, headers={"Location": f"/webhooks/{row.id}",
                                                           "Cache-Control": "no-store"})

    @get("/", operation_id="list_webhooks", summary="The tenant's webhook endpoints, newest first",
         responses=problems(400, 401))
    async def list_endpoints(self, request: Request, limit: Limit = None, cursor: Cursor = None) -> EndpointList:
        tenant = _tenant(request)
        errors: list[FieldError] = []
        size = _limit(limit, errors)
        if errors:
            raise InvalidRequest(errors)
        before = decode_position(cursor) if cursor is not None else None
        rows = await _webhooks(request).list_endpoints(tenant, before=before, limit=size + 1)
        page = rows[:size]
        more = len(rows) > size
        return EndpointList(
            items=await _endpoint_views(request, page),
            next_cursor=encode_position(page[-1].created_at, page[-1].id) if more else None,
        )

    @get("/callback-secret", operation_id="get_callback_secret",
         summary="The secret that signs deliveries to jobs' callback_url", responses=problems(401),
         cache_control=NO_STORE)
    async def callback_secret(self, request: Request) -> SigningSecret:
        tenant = _tenant(request)
        key = await _webhooks(request).callback_key(tenant)
        return secret_view(key)

    @post("/callback-secret/rotate", operation_id="rotate_callback_secret", status_code=200,
          summary="A new callback secret; the old one keeps signing for 24 h", responses=problems(401),
          cache_control=NO_STORE)
    async def rotate_callback_secret(self, request: Request) -> SigningSecret:
        tenant = _tenant(request)
        key = await _webhooks(request).rotate_callback_key(tenant)
        return secret_view(key)

    @get("/{endpoint_id:str}", operation_id="get_webhook", summary="One webhook endpoint",
         responses=problems(401, 404))
    async def get_endpoint(self, request: Request, endpoint_id: FromPath[str]) -> Endpoint:
        tenant = _tenant(request)
        return (await _endpoint_views(request, [await _endpoint(request, tenant, endpoint_id)]))[0]

    @patch("/{endpoint_id:str}", operation_id="update_webhook",
           summary="Change url, event_types, kinds or status (enabled/disabled)",
           operation_class=with_body(EndpointPatch, "The fields to change"), responses=problems(400, 401, 404, 415))
    async def update(self, request: Request, endpoint_id: FromPath[str]) -> Endpoint:
        tenant = _tenant(request)
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
        if changes.get("status") == "disabled":
            await _changed(request, tenant, endpoint_id)  # its pending deliveries just failed
        return (await _endpoint_views(request, [row]))[0]

    @delete("/{endpoint_id:str}", operation_id="delete_webhook", status_code=204,
            summary="Delete the endpoint with its delivery log", responses=problems(401, 404))
    async def remove(self, request: Request, endpoint_id: FromPath[str]) -> None:
        tenant = _tenant(request)
        await _endpoint(request, tenant, endpoint_id)
        if not await _webhooks(request).delete_endpoint(tenant, endpoint_id):
            raise NotFound(NO_ENDPOINT)
        await _changed(request, tenant, None)

    @post("/{endpoint_id:str}/rotate-secret", operation_id="rotate_webhook_secret", status_code=200,
          summary="A new secret (or key pair); the old one keeps signing for 24 h", responses=problems(401, 404),
          cache_control=NO_STORE)
    async def rotate(self, request: Request, endpoint_id: FromPath[str]) -> SigningSecret:
        tenant = _tenant(request)
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
        endpoint_id: FromPath[str],
        status: StatusFilter = None,
        limit: Limit = None,
        cursor: Cursor = None,
    ) -> DeliveryList:
        tenant = _tenant(request)
        endpoint = await _endpoint(request, tenant, endpoint_id)
        errors: list[FieldError] = []
        size = _limit(limit, errors)
        if status is not None and status not in DELIVERY_STATUSES:
            errors.append(FieldError(field="status", message=f"must be one of {', '.join(DELIVERY_STATUSES)}"))
        if errors:
            raise InvalidRequest(errors)
        # A delivery's seq is numbered across every tenant's deliveries: sealed, so that the
        # gaps between a tenant's cursors do not count the other tenants' webhook traffic.
        sealer, scope = services(request).storage.sealer, _deliveries_scope(endpoint.id)
        before = open_seq(sealer, cursor, scope) if cursor is not None else None
        store = _webhooks(request)
        rows = await store.list_deliveries(endpoint.id, status=status, before_seq=before, limit=size + 1)
        page = rows[:size]
        return DeliveryList(
            items=await _delivery_views(store, page),
            next_cursor=seal_seq(sealer, page[-1].seq, scope) if len(rows) > size else None,
        )

    @post("/{endpoint_id:str}/deliveries/{delivery_id:str}/retry", operation_id="retry_webhook_delivery",
          status_code=202, summary="Send the delivery again now, with the same webhook-id, whatever its status",
          description="Asked while an attempt of the delivery is in flight, the request is kept for that attempt:"
                      " a 2xx delivers it, anything else sends it again at once, whatever the retry schedule says.",
          responses=problems(401, 404, 409))
    async def retry(self, request: Request, endpoint_id: FromPath[str], delivery_id: FromPath[str]) -> Response[Delivery]:
        tenant = _tenant(request)
        endpoint = await _endpoint(request, tenant, endpoint_id)
        store = _webhooks(request)
        if not is_uuid(delivery_id) or await store.get_delivery(endpoint.id, delivery_id) is None:
            raise NotFound("no such delivery")
        if endpoint.status != "enabled":
            raise EndpointDisabled("enable the endpoint (PATCH status: enabled) before retrying its deliveries")
        row = await store.retry_now(endpoint.id, delivery_id)
        if row is None:
            raise NotFound("no such delivery")
        await _changed(request, tenant, endpoint.id)
        return Response((await _delivery_views(store, [row]))[0], status_code=202,
                        headers={"Cache-Control": "no-store"})

    @get("/{endpoint_id:str}/deliveries/{delivery_id:str}", operation_id="get_webhook_delivery",
         summary="One delivery with its attempts and the payload that was signed", responses=problems(401, 404))
    async def delivery(self, request: Request, endpoint_id: FromPath[str], delivery_id: FromPath[str]) -> Delivery:
        tenant = _tenant(request)
        endpoint = await _endpoint(request, tenant, endpoint_id)
        store = _webhooks(request)
        row = await store.get_delivery(endpoint.id, delivery_id) if is_uuid(delivery_id) else None
        if row is None:
            raise NotFound("no such delivery")
        return (await _delivery_views(store, [row]))[0]

    @post("/{endpoint_id:str}/recover", operation_id="recover_webhook", status_code=202,
          summary="Send again every failed delivery of the endpoint created since a time",
          operation_class=with_body(RecoverRequest, "Since when"), responses=problems(400, 401, 404, 409, 415))
    async def recover(self, request: Request, endpoint_id: FromPath[str]) -> Response[Recovered]:
        """Each failed delivery created at or after ``since`` is made due now, as ``/retry`` does
        (same id, same ``webhook-id``); ``count`` says how many."""
        tenant = _tenant(request)
        endpoint = await _endpoint(request, tenant, endpoint_id)
        body = await _body(request, RecoverRequest)
        if endpoint.status != "enabled":
            raise EndpointDisabled("enable the endpoint (PATCH status: enabled) before recovering its deliveries")
        count = await _webhooks(request).recover(tenant, endpoint.id, body.since.timestamp())
        if count:
            await _changed(request, tenant, endpoint.id)
        return Response(Recovered(count=count), status_code=202, headers={"Cache-Control": "no-store"})

    @post("/{endpoint_id:str}/test", operation_id="test_webhook", status_code=202,
          summary="Send the endpoint a signed webhook.test event, through the same queue as every event",
          responses=problems(401, 404, 409, 429))
    async def send_test(self, request: Request, endpoint_id: FromPath[str]) -> Response[Delivery]:
        """202 with the delivery: ``type`` ``webhook.test``, ``job_id`` and ``version`` null, payload
        ``{"type": "webhook.test", "timestamp", "data": {"endpoint_id", "message"}}``."""
        tenant = _tenant(request)
        endpoint = await _endpoint(request, tenant, endpoint_id)
        if endpoint.status != "enabled":
            raise EndpointDisabled("enable the endpoint (PATCH status: enabled) before sending it a test event")
        event_id, job_key = new_test_event()
        data = WebhookTestData(endpoint_id=endpoint.id, message=TEST_MESSAGE)
        body = _encoder.encode(WebhookPayload(type=TEST_EVENT_TYPE, timestamp=rfc3339(time.time()) or "",
                                              data=msgspec.Raw(_encoder.encode(data))))
        store = _webhooks(request)
        try:
            row = await store.add_test_delivery(tenant, endpoint.id, event_id, job_key, body)
        except TestEventsLimited as exc:
            wait = max(1, math.ceil(exc.retry_after_s))
            raise RateLimited(f"{exc}; retry after {wait} s", retry_after=wait) from None
        if row is None:  # disabled or deleted meanwhile
            raise EndpointDisabled("the endpoint was disabled or deleted meanwhile")
        await _changed(request, tenant, endpoint.id)
        return Response(delivery_view(row, [], body), status_code=202, headers={"Cache-Control": "no-store"})

    @get("/events", operation_id="webhook_events", summary="Server-sent notices that the tenant's deliveries "
         "changed (event: deliveries, data: {endpoint_id}): read them again", media_type="text/event-stream",
         opt={EVENT_STREAM_OPT: True},
         responses=problems(400, 401, 403, 429))
    async def events(
        self,
        request: Request,
        exp: Annotated[str | None, QueryParameter(name="exp", max_length=12)] = None,
        sig: Annotated[str | None, QueryParameter(name="sig", max_length=100)] = None,
        tenant: Annotated[str | None, QueryParameter(name="tenant", max_length=64,
                                                description="of a signed URL from POST /webhooks/events/link")] = None,
    ) -> Any:
        """``retry:``, then ``event: deliveries`` with ``{"endpoint_id": …}`` (null: any endpoint)
        whenever a notifier or the API changed the tenant's deliveries; the first one, null, at
        once on every (re)connect. Hints, not data: read the deliveries again on each."""
        svc = services(request)
        owner = _webhook_events_tenant(request, svc)
        return EventStream(_notice_stream(svc, owner), slot=svc.limiter.stream_slot(owner))

    @post("/events/link", operation_id="webhook_events_link", status_code=200,
          summary="A signed URL for GET /webhooks/events (for EventSource, which cannot send a key)",
          responses=problems(401), cache_control=NO_STORE)
    async def events_link(self, request: Request) -> EventLink:
        svc = services(request)
        tenant = _tenant(request)
        url = svc.signer.sign("/webhooks/events", WEBHOOK_EVENTS_PURPOSE, extra=tenant)
        return EventLink(url=f"{url}&tenant={quote(tenant, safe='')}", expires_in=int(svc.settings.signed_url_ttl_s))
