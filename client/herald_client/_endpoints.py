"""The webhook API as flows (SPEC §7): endpoints, their deliveries, recover, test events,
portal links. Both clients call these; each is one JSON request through ``_core.call``."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

from herald_client import _core
from herald_client._core import Context, Flow
from herald_client.models import (
    CreatedEndpoint,
    Delivery,
    DeliveryList,
    Endpoint,
    EndpointList,
    PortalLink,
    Recovered,
    SigningSecret,
)


class _Keep(enum.Enum):
    KEEP = "keep"


KEEP = _Keep.KEEP
"""``update_webhook(..., kinds=KEEP)``: leave the field as it is (``kinds=None`` means every kind)."""


def endpoint_id(endpoint: Endpoint | str) -> str:
    return quote(endpoint.id if isinstance(endpoint, Endpoint) else endpoint, safe="")


def delivery_id(delivery: Delivery | str) -> str:
    return quote(delivery.id if isinstance(delivery, Delivery) else delivery, safe="")


def _query(**params: Any) -> str:
    present = {k: v for k, v in params.items() if v is not None}
    return f"?{urlencode(present)}" if present else ""


def create(url: str, event_types: Sequence[str] | None, kinds: Sequence[str] | None, signature: str,
           ctx: Context) -> Flow[CreatedEndpoint]:
    body: dict[str, Any] = {"url": url, "signature": signature}
    if event_types is not None:
        body["event_types"] = list(event_types)
    if kinds is not None:
        body["kinds"] = list(kinds)
    return (yield from _core.json_call("POST", "/webhooks", body, CreatedEndpoint, ctx, replay_safe=False))


def listing(limit: int | None, cursor: str | None, ctx: Context) -> Flow[EndpointList]:
    return (yield from _core.json_call("GET", f"/webhooks{_query(limit=limit, cursor=cursor)}", None, EndpointList,
                                       ctx, replay_safe=True))


def get(endpoint: Endpoint | str, ctx: Context) -> Flow[Endpoint]:
    return (yield from _core.json_call("GET", f"/webhooks/{endpoint_id(endpoint)}", None, Endpoint, ctx,
                                       replay_safe=True))


def update(endpoint: Endpoint | str, url: str | None, event_types: Sequence[str] | None,
           kinds: Sequence[str] | None | _Keep, status: str | None, ctx: Context) -> Flow[Endpoint]:
    body: dict[str, Any] = {}
    if url is not None:
        body["url"] = url
    if event_types is not None:
        body["event_types"] = list(event_types)
    if kinds is not KEEP:
        body["kinds"] = list(kinds) if kinds is not None else None
    if status is not None:
        body["status"] = status
    return (yield from _core.json_call("PATCH", f"/webhooks/{endpoint_id(endpoint)}", body, Endpoint, ctx,
                                       replay_safe=True))


def delete(endpoint: Endpoint | str, ctx: Context) -> Flow[None]:
    yield from _core.empty_call("DELETE", f"/webhooks/{endpoint_id(endpoint)}", ctx, replay_safe=True)


def rotate(endpoint: Endpoint | str, ctx: Context) -> Flow[SigningSecret]:
    return (yield from _core.json_call("POST", f"/webhooks/{endpoint_id(endpoint)}/rotate-secret", None,
                                       SigningSecret, ctx, replay_safe=False))


def deliveries(endpoint: Endpoint | str, status: str | None, limit: int | None, cursor: str | None,
               ctx: Context) -> Flow[DeliveryList]:
    path = f"/webhooks/{endpoint_id(endpoint)}/deliveries{_query(status=status, limit=limit, cursor=cursor)}"
    return (yield from _core.json_call("GET", path, None, DeliveryList, ctx, replay_safe=True))


def delivery(endpoint: Endpoint | str, item: Delivery | str, ctx: Context) -> Flow[Delivery]:
    path = f"/webhooks/{endpoint_id(endpoint)}/deliveries/{delivery_id(item)}"
    return (yield from _core.json_call("GET", path, None, Delivery, ctx, replay_safe=True))


def retry(endpoint: Endpoint | str, item: Delivery | str, ctx: Context) -> Flow[Delivery]:
    path = f"/webhooks/{endpoint_id(endpoint)}/deliveries/{delivery_id(item)}/retry"
    return (yield from _core.json_call("POST", path, None, Delivery, ctx, replay_safe=False))


def recover(endpoint: Endpoint | str, since: datetime | str, ctx: Context) -> Flow[int]:
    if isinstance(since, datetime):
        if since.tzinfo is None:
            raise ValueError("since needs a timezone (e.g. datetime.now(timezone.utc))")
        since = since.isoformat()
    # Sending it twice does no harm: what the first made pending is not failed any more.
    found = yield from _core.json_call("POST", f"/webhooks/{endpoint_id(endpoint)}/recover", {"since": since},
                                       Recovered, ctx, replay_safe=True)
    return found.count


def send_test(endpoint: Endpoint | str, ctx: Context) -> Flow[Delivery]:
    return (yield from _core.json_call("POST", f"/webhooks/{endpoint_id(endpoint)}/test", None, Delivery, ctx,
                                       replay_safe=False))


def portal_link(ctx: Context) -> Flow[PortalLink]:
    return (yield from _core.json_call("POST", "/portal/link", None, PortalLink, ctx, replay_safe=True))


def callback_secret(ctx: Context) -> Flow[SigningSecret]:
    return (yield from _core.json_call("GET", "/webhooks/callback-secret", None, SigningSecret, ctx,
                                       replay_safe=True))


def rotate_callback_secret(ctx: Context) -> Flow[SigningSecret]:
    return (yield from _core.json_call("POST", "/webhooks/callback-secret/rotate", None, SigningSecret, ctx,
                                       replay_safe=False))
