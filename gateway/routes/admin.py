"""The admin API (SPEC §12): tenants, their scoped keys and limits, and the audit log.

Every route takes the operator's ``HERALD_ADMIN_KEY`` (``gateway.auth.require_admin``).
Each change is one store transaction with its audit row; afterwards this gateway reloads
its directory and broadcasts the change, so it holds on every process within 2 s
(``herald.directory``). Tenants of ``HERALD_API_KEYS`` are configuration: they are listed
with ``source: env``, their limits may be changed (a stored row then carries them), and
their keys cannot be revoked here (409).
"""

from __future__ import annotations

import re
from typing import Annotated

from litestar import Controller, Request, Response, delete, get, patch, post
from litestar.params import FromPath, QueryParameter

from gateway.auth import require_admin
from gateway.bodies import read_body
from gateway.cursors import decode_name, decode_seq, encode_name, encode_seq
from gateway.openapi import problems, with_body
from gateway.problems import EnvKey, InvalidRequest, NotFound, TenantExists
from gateway.services import Services, services
from herald.directory import Directory
from herald.tenants import ALL_SCOPES, SOURCE_ENV, KeyRow, TenantRow, issue_key
from herald.timefmt import LATEST, now, rfc3339
from schemas import FieldError
from schemas.admin import (
    TENANT_ID_PATTERN, ApiKey, ApiKeyList, AuditEntry, AuditList, CreatedApiKey, KeyCreate, LimitsPatch, Tenant,
    TenantCreate, TenantLimits, TenantList, TenantUpdate,
)

NO_STORE = {"Cache-Control": "no-store"}
_TENANT_ID = re.compile(TENANT_ID_PATTERN)
_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # issued: 16 hex digits; HERALD_API_KEYS': env-<12 hex>


def _svc(request: Request) -> Services:
    svc = services(request)
    require_admin(request, svc)
    return svc


def tenant_view(row: TenantRow, directory: Directory) -> Tenant:
    limits = row.effective_limits(directory.defaults)
    return Tenant(
        id=row.id,
        created_at=rfc3339(row.created_at) if row.created_at else None,
        disabled=row.disabled,
        limits=TenantLimits(rate_limit=limits.rate_limit, max_running=limits.max_running,
                            max_endpoints=limits.max_endpoints, max_streams=limits.max_streams),
        source="env" if directory.is_env_tenant(row.id) else "api",
    )


def _env_row(tenant_id: str) -> TenantRow:
    """A HERALD_API_KEYS tenant never changed over the API: default limits, enabled."""
    return TenantRow(id=tenant_id, created_at=0.0, disabled=False, limits={}, source=SOURCE_ENV)


def key_view(key: KeyRow) -> ApiKey:
    return ApiKey(id=key.id, tenant=key.tenant, name=key.name, scopes=list(key.scopes),
                  created_at=rfc3339(key.created_at) if key.created_at else None,
                  expires_at=rfc3339(key.expires_at), last_used_at=rfc3339(_to_minute(key.last_used_at)),
                  source="env" if key.source == SOURCE_ENV else "api")


def _to_minute(at: float | None) -> float | None:
    return None if at is None else at - at % 60


async def _changed(svc: Services) -> None:
    """Make the change hold here now, and everywhere within moments."""
    await svc.directory.refresh()
    await Directory.announce(svc.nats)


async def _tenant_row(svc: Services, tenant_id: str) -> TenantRow:
    if not _TENANT_ID.match(tenant_id):  # e.g. a NUL byte, which PostgreSQL's text refuses outright
        raise NotFound(f"no tenant {tenant_id!r}")
    row = await svc.storage.tenants.get_tenant(tenant_id)
    if row is not None:
        return row
    if svc.directory.is_env_tenant(tenant_id):
        return _env_row(tenant_id)
    raise NotFound(f"no tenant {tenant_id!r}")


class AdminController(Controller):
    path = "/admin"
    tags = ["admin"]
    security = [{"admin": []}]

    @post("/tenants", operation_id="create_tenant", status_code=201, summary="Create a tenant",
          operation_class=with_body(TenantCreate, "The tenant's id and, optionally, its own limits"),
          responses=problems(400, 401, 403, 409, 415))
    async def create_tenant(self, request: Request) -> Response[Tenant]:
        svc = _svc(request)
        body, _ = await read_body(request, TenantCreate)
        limits = {name: value for name, value in (body.limits.given() if body.limits else {}).items()
                  if value is not None}
        if svc.directory.is_env_tenant(body.id):
            raise TenantExists(f"tenant {body.id!r} exists (from HERALD_API_KEYS)")
        row = await svc.storage.tenants.create_tenant(body.id, limits)
        if row is None:
            raise TenantExists(f"tenant {body.id!r} exists")
        await _changed(svc)
        return Response(tenant_view(row, svc.directory), status_code=201,
                        headers={**NO_STORE, "Location": f"/admin/tenants/{row.id}"})

    @get("/tenants", operation_id="list_tenants", summary="Every tenant, by id", responses=problems(400, 401, 403))
    async def list_tenants(
        self,
        request: Request,
        limit: Annotated[int, QueryParameter(name="limit", ge=1, le=100)] = 50,
        cursor: Annotated[str | None, QueryParameter(name="cursor", max_length=200)] = None,
    ) -> Response[TenantList]:
        svc = _svc(request)
        after = decode_name(cursor) if cursor is not None else None  # empty: no cursor given out, a 400
        stored = await svc.storage.tenants.list_tenants(after=after, limit=limit + 1)
        rows = {row.id: row for row in stored}
        for tenant_id in svc.directory.env_tenants:
            if (after is None or tenant_id > after) and tenant_id not in rows:
                rows[tenant_id] = _env_row(tenant_id)
        ordered = sorted(rows.values(), key=lambda row: row.id)
        if len(stored) > limit:  # a stored row past the page bounds what this page may show
            ordered = [row for row in ordered if row.id < stored[-1].id]
        page = ordered[:limit]
        more = len(ordered) > limit or len(stored) > limit
        return Response(TenantList(items=[tenant_view(row, svc.directory) for row in page],
                                   next_cursor=encode_name(page[-1].id) if more and page else None),
                        headers=NO_STORE)

    @get("/tenants/{tenant_id:str}", operation_id="get_tenant", summary="A tenant",
         responses=problems(401, 403, 404))
    async def get_tenant(self, request: Request, tenant_id: FromPath[str]) -> Response[Tenant]:
        svc = _svc(request)
        return Response(tenant_view(await _tenant_row(svc, tenant_id), svc.directory), headers=NO_STORE)

    @patch("/tenants/{tenant_id:str}", operation_id="update_tenant", summary="Change a tenant's limits, or disable it",
           operation_class=with_body(TenantUpdate, "limits (null: back to the default) and/or disabled"),
           responses=problems(400, 401, 403, 404, 415))
    async def update_tenant(self, request: Request, tenant_id: FromPath[str]) -> Response[Tenant]:
        """A disabled tenant's keys and portal sessions get 401 (within 2 s everywhere); its jobs
        keep running and its webhooks keep going out."""
        svc = _svc(request)
        body, _ = await read_body(request, TenantUpdate)
        row = await _tenant_row(svc, tenant_id)
        updated = await svc.storage.tenants.update_tenant(
            tenant_id,
            limits=body.limits.given() if isinstance(body.limits, LimitsPatch) else None,
            disabled=body.disabled if isinstance(body.disabled, bool) else None,
            # An env tenant's first change makes the row that carries it: audited as that change.
            source_if_new=SOURCE_ENV if row.source == SOURCE_ENV else None,
        )
        if updated is None:
            raise NotFound(f"no tenant {tenant_id!r}")
        await _changed(svc)
        return Response(tenant_view(updated, svc.directory), headers=NO_STORE)

    @post("/tenants/{tenant_id:str}/keys", operation_id="create_key", status_code=201,
          summary="Create an API key for the tenant (the key is in this answer only)",
          operation_class=with_body(KeyCreate, "name, scopes (default: all) and expiry"),
          responses=problems(400, 401, 403, 404, 415))
    async def create_key(self, request: Request, tenant_id: FromPath[str]) -> Response[CreatedApiKey]:
        svc = _svc(request)
        body, _ = await read_body(request, KeyCreate)
        await _tenant_row(svc, tenant_id)
        expires_at = body.expires_at.timestamp() if body.expires_at is not None else None
        if expires_at is not None and expires_at <= now():
            raise InvalidRequest([FieldError(field="expires_at", message="must be in the future")])
        if expires_at is not None and expires_at > LATEST:
            raise InvalidRequest([FieldError(field="expires_at", message="must be before the year 10000 (UTC)")])
        scopes = tuple(s for s in ALL_SCOPES if body.scopes is None or s in body.scopes)
        issued = issue_key()
        row = await svc.storage.tenants.create_key(KeyRow(
            id=issued.id, tenant=tenant_id, name=body.name, scopes=scopes, digest=issued.digest,
            created_at=0.0, expires_at=expires_at))
        await _changed(svc)
        view = key_view(row)
        created = CreatedApiKey(**{f: getattr(view, f) for f in view.__struct_fields__}, key=issued.plaintext)
        return Response(created, status_code=201, headers=NO_STORE)

    @get("/tenants/{tenant_id:str}/keys", operation_id="list_keys", summary="The tenant's keys (never the keys themselves)",
         responses=problems(401, 403, 404))
    async def list_keys(self, request: Request, tenant_id: FromPath[str]) -> Response[ApiKeyList]:
        svc = _svc(request)
        await _tenant_row(svc, tenant_id)
        keys = [*svc.directory.env_keys_of(tenant_id), *await svc.storage.tenants.list_keys(tenant_id)]
        return Response(ApiKeyList(items=[key_view(key) for key in keys]), headers=NO_STORE)

    @delete("/keys/{key_id:str}", operation_id="revoke_key", status_code=204,
            summary="Revoke a key: 401 on every gateway within 2 s, and so for the portal sessions it opened",
            responses=problems(401, 403, 404, 409))
    async def revoke_key(self, request: Request, key_id: FromPath[str]) -> None:
        svc = _svc(request)
        if svc.directory.env_key(key_id) is not None:
            raise EnvKey("this key comes from HERALD_API_KEYS: remove it there and restart, or disable the tenant")
        if not _KEY_ID.fullmatch(key_id) or await svc.storage.tenants.revoke_key(key_id) is None:
            raise NotFound(f"no key {key_id!r}")
        await _changed(svc)

    @get("/audit", operation_id="audit_log", summary="What was changed, newest first (never a key or a secret)",
         responses=problems(400, 401, 403))
    async def audit(
        self,
        request: Request,
        limit: Annotated[int, QueryParameter(name="limit", ge=1, le=100)] = 50,
        cursor: Annotated[str | None, QueryParameter(name="cursor", max_length=200)] = None,
    ) -> Response[AuditList]:
        svc = _svc(request)
        before = decode_seq(cursor) if cursor is not None else None
        rows = await svc.storage.tenants.audit_log(before=before, limit=limit + 1)
        page = rows[:limit]
        items = [AuditEntry(id=row.id, at=rfc3339(row.at) or "", action=row.action, tenant=row.tenant,
                            key_id=row.key_id, detail=dict(row.detail)) for row in page]
        return Response(AuditList(items=items, next_cursor=encode_seq(int(page[-1].id)) if len(rows) > limit else None),
                        headers=NO_STORE)
