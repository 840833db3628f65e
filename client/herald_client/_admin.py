"""The admin API as flows (SPEC §12): tenants, their keys, the audit log. Both admin
clients call these; each is one JSON request through ``_core.call``, and a listing is a
flow that emits every item, page after page."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import urlencode

import msgspec

from herald_client import _core
from herald_client._core import Context, Emit, Flow
from herald_client._shared import path_segment
from herald_client.models import (
    ApiKey,
    AuditList,
    CreatedKey,
    KeyList,
    Tenant,
    TenantLimits,
    TenantList,
)

LimitsArg = TenantLimits | Mapping[str, float | None]
"""Limits to set: a ``TenantLimits``, or a mapping with only the limits to change
(``{"rate_limit": 5}``; ``None``: back to the deployment's default); the others keep their
value (on create: the deployment's default)."""

Page = TypeVar("Page", TenantList, KeyList, AuditList)

TENANTS = "/admin/tenants"
AUDIT = "/admin/audit"


def tenant_id(tenant: Tenant | str) -> str:
    return path_segment(tenant.id if isinstance(tenant, Tenant) else tenant, "tenant")


def key_id(key: ApiKey | str) -> str:
    return path_segment(key.id if isinstance(key, ApiKey) else key, "key")


def _limits(limits: LimitsArg) -> dict[str, Any]:
    body = msgspec.structs.asdict(limits) if isinstance(limits, TenantLimits) else dict(limits)
    for name, value in body.items():
        # JSON has no inf or nan: msgspec would send null, which resets the limit to the default.
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"limits[{name!r}] must be a finite number, not {value} "
                             "(None goes back to the deployment's default)")
    return body


def _rfc3339(at: datetime | str) -> str:
    if isinstance(at, str):
        return at
    if at.tzinfo is None:
        raise ValueError("expires_at needs a timezone (e.g. datetime.now(timezone.utc))")
    return at.isoformat()


def each(path: str, page: type[Page], page_size: int | None, ctx: Context) -> Flow[None]:
    """Emit every item of a paged listing, following ``next_cursor`` to its end."""
    cursor: str | None = None
    while True:
        params = {k: v for k, v in (("limit", page_size), ("cursor", cursor)) if v is not None}
        query = f"?{urlencode(params)}" if params else ""
        found = yield from _core.json_call("GET", path + query, None, page, ctx, replay_safe=True)
        for item in found.items:
            yield Emit(item)
        cursor = getattr(found, "next_cursor", None)  # a key listing is one page
        if not cursor or not found.items:
            return


def create_tenant(tenant: str, limits: LimitsArg | None, ctx: Context) -> Flow[Tenant]:
    body: dict[str, Any] = {"id": tenant}
    if limits is not None:
        body["limits"] = _limits(limits)
    # Sent once: a retried create that had succeeded would answer 409.
    return (yield from _core.json_call("POST", TENANTS, body, Tenant, ctx, replay_safe=False))


def get_tenant(tenant: Tenant | str, ctx: Context) -> Flow[Tenant]:
    return (yield from _core.json_call("GET", f"{TENANTS}/{tenant_id(tenant)}", None, Tenant, ctx,
                                       replay_safe=True))


def update_tenant(tenant: Tenant | str, limits: LimitsArg | None, disabled: bool | None,
                  ctx: Context) -> Flow[Tenant]:
    body: dict[str, Any] = {}
    if limits is not None:
        body["limits"] = _limits(limits)
    if disabled is not None:
        body["disabled"] = disabled
    return (yield from _core.json_call("PATCH", f"{TENANTS}/{tenant_id(tenant)}", body, Tenant, ctx,
                                       replay_safe=True))


def create_key(tenant: Tenant | str, name: str, scopes: Collection[str] | None, expires_at: datetime | str | None,
               ctx: Context) -> Flow[CreatedKey]:
    body: dict[str, Any] = {"name": name}
    if scopes is not None:
        body["scopes"] = list(scopes)
    if expires_at is not None:
        body["expires_at"] = _rfc3339(expires_at)
    # Sent once: a retry after a lost answer would mint a second key.
    return (yield from _core.json_call("POST", keys_path(tenant), body, CreatedKey, ctx,
                                       replay_safe=False))


def revoke_key(key: ApiKey | str, ctx: Context) -> Flow[None]:
    yield from _core.empty_call("DELETE", f"/admin/keys/{key_id(key)}", ctx, replay_safe=True)


def keys_path(tenant: Tenant | str) -> str:
    return f"{TENANTS}/{tenant_id(tenant)}/keys"
