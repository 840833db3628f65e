"""PostgreSQL: tenants, API keys (hashes) and the admin audit log (``TenantStore``, SPEC §12).

Admin changes are rare, so each is a plain transaction (no group commit); the version row
is bumped in it, which also serialises concurrent admin changes (they are not a hot path).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from herald.jobs import StoreUnavailable
from herald.storage.postgres.db import CONNECTION_ERRORS, NOW_SQL, PgDatabase, unavailable_on_connection_errors
from herald.tenants import (
    KEY_CREATED, KEY_REVOKED, SOURCE_API, TENANT_CREATED, TENANT_DISABLED, TENANT_UPDATED,
    AuditRow, DirectorySnapshot, KeyRow, TenantRow, merged_limits,
)

# The tables: sql/0011_tenants.sql beside this package's schema.py.

_KEY_COLUMNS = "id, tenant, name, scopes, digest, created_at, expires_at, last_used_at"


def _tenant(row: asyncpg.Record) -> TenantRow:
    return TenantRow(id=row["id"], created_at=row["created_at"], disabled=row["disabled"],
                     limits=json.loads(row["limits"]), source=row["source"])


def _key(row: asyncpg.Record) -> KeyRow:
    return KeyRow(id=row["id"], tenant=row["tenant"], name=row["name"], scopes=tuple(row["scopes"].split(",")),
                  digest=bytes(row["digest"]), created_at=row["created_at"], expires_at=row["expires_at"],
                  last_used_at=row["last_used_at"])


async def _changed(conn: Any, action: str, tenant: str | None, key_id: str | None,
                   detail: Mapping[str, Any]) -> None:
    await conn.execute(f"INSERT INTO herald_audit (at, action, tenant, key_id, detail) VALUES ({NOW_SQL}, $1, $2, $3, $4)",
                       action, tenant, key_id, json.dumps(detail, sort_keys=True))
    await conn.execute("UPDATE herald_directory SET version = version + 1 WHERE id = 1")


@unavailable_on_connection_errors
class PgTenantStore:
    def __init__(self, db: PgDatabase) -> None:
        self._db = db

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[Any]:
        try:
            async with self._db.pool.acquire() as conn, conn.transaction():
                yield conn
        except CONNECTION_ERRORS as exc:
            raise StoreUnavailable(f"the PostgreSQL store is not reachable (HERALD_DATABASE_URL): {exc}") from exc

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        try:
            return await self._db.pool.fetch(sql, *args)  # type: ignore[no-any-return]
        except CONNECTION_ERRORS as exc:
            raise StoreUnavailable(f"the PostgreSQL store is not reachable (HERALD_DATABASE_URL): {exc}") from exc

    async def directory_version(self) -> int:
        rows = await self._fetch("SELECT version FROM herald_directory WHERE id = 1")
        return int(rows[0]["version"])

    async def snapshot(self) -> DirectorySnapshot:
        # REPEATABLE READ: the version and the rows are read from one snapshot.
        try:
            async with self._db.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
                version = await conn.fetchval("SELECT version FROM herald_directory WHERE id = 1")
                tenants = [_tenant(r) for r in await conn.fetch("SELECT * FROM herald_tenants")]
                keys = [_key(r) for r in await conn.fetch(
                    f"SELECT {_KEY_COLUMNS} FROM herald_api_keys WHERE revoked_at IS NULL")]
        except CONNECTION_ERRORS as exc:
            raise StoreUnavailable(f"the PostgreSQL store is not reachable (HERALD_DATABASE_URL): {exc}") from exc
        return DirectorySnapshot(version=int(version), tenants=tenants, keys=keys)

    async def create_tenant(self, tenant_id: str, limits: Mapping[str, float], *, source: str = SOURCE_API,
                            disabled: bool = False) -> TenantRow | None:
        async with self._tx() as conn:
            row = await conn.fetchrow(
                f"INSERT INTO herald_tenants (id, created_at, disabled, source, limits) VALUES ($1, {NOW_SQL}, $2, $3, $4)"
                " ON CONFLICT (id) DO NOTHING RETURNING *",
                tenant_id, disabled, source, json.dumps(dict(limits), sort_keys=True))
            if row is None:
                return None
            await _changed(conn, TENANT_CREATED, tenant_id, None, {"limits": dict(limits), "source": source})
            return _tenant(row)

    async def get_tenant(self, tenant_id: str) -> TenantRow | None:
        rows = await self._fetch("SELECT * FROM herald_tenants WHERE id = $1", tenant_id)
        return _tenant(rows[0]) if rows else None

    async def list_tenants(self, *, after: str | None, limit: int) -> list[TenantRow]:
        rows = await self._fetch("SELECT * FROM herald_tenants WHERE id > $1 ORDER BY id LIMIT $2", after or "", limit)
        return [_tenant(r) for r in rows]

    async def update_tenant(self, tenant_id: str, *, limits: Mapping[str, float | None] | None,
                            disabled: bool | None, source_if_new: str | None = None) -> TenantRow | None:
        async with self._tx() as conn:
            if source_if_new is not None:  # no audit row of its own: the change below has one
                await conn.execute(
                    f"INSERT INTO herald_tenants (id, created_at, disabled, source, limits)"
                    f" VALUES ($1, {NOW_SQL}, false, $2, '{{}}') ON CONFLICT (id) DO NOTHING", tenant_id, source_if_new)
            row = await conn.fetchrow("SELECT * FROM herald_tenants WHERE id = $1 FOR UPDATE", tenant_id)
            if row is None:
                return None
            current = _tenant(row)
            merged = merged_limits(current.limits, limits)
            now_disabled = current.disabled if disabled is None else disabled
            await conn.execute("UPDATE herald_tenants SET limits = $2, disabled = $3 WHERE id = $1",
                               tenant_id, json.dumps(merged, sort_keys=True), now_disabled)
            if limits is not None:
                await _changed(conn, TENANT_UPDATED, tenant_id, None, {"limits": dict(limits)})
            if disabled is not None and disabled != current.disabled:
                await _changed(conn, TENANT_DISABLED if disabled else TENANT_UPDATED, tenant_id, None,
                               {"disabled": disabled})
            return TenantRow(id=tenant_id, created_at=current.created_at, disabled=now_disabled, limits=merged,
                             source=current.source)

    async def create_key(self, key: KeyRow) -> KeyRow:
        async with self._tx() as conn:
            row = await conn.fetchrow(
                "INSERT INTO herald_api_keys (id, tenant, name, scopes, digest, created_at, expires_at)"
                f" VALUES ($1, $2, $3, $4, $5, {NOW_SQL}, $6) RETURNING {_KEY_COLUMNS}",
                key.id, key.tenant, key.name, ",".join(key.scopes), key.digest, key.expires_at)
            await _changed(conn, KEY_CREATED, key.tenant, key.id, {"name": key.name, "scopes": list(key.scopes)})
            return _key(row)

    async def list_keys(self, tenant_id: str) -> list[KeyRow]:
        rows = await self._fetch(f"SELECT {_KEY_COLUMNS} FROM herald_api_keys WHERE tenant = $1 AND revoked_at IS NULL"
                                 " ORDER BY created_at, id", tenant_id)
        return [_key(r) for r in rows]

    async def get_key(self, key_id: str) -> KeyRow | None:
        rows = await self._fetch(f"SELECT {_KEY_COLUMNS} FROM herald_api_keys WHERE id = $1 AND revoked_at IS NULL",
                                 key_id)
        return _key(rows[0]) if rows else None

    async def revoke_key(self, key_id: str) -> KeyRow | None:
        async with self._tx() as conn:
            row = await conn.fetchrow(
                f"UPDATE herald_api_keys SET revoked_at = {NOW_SQL} WHERE id = $1 AND revoked_at IS NULL"
                f" RETURNING {_KEY_COLUMNS}", key_id)
            if row is None:
                return None
            key = _key(row)
            await _changed(conn, KEY_REVOKED, key.tenant, key.id, key.revoked_detail())
            return key

    async def touch_keys(self, used_at: Mapping[str, float]) -> None:
        if not used_at:
            return
        ids, times = list(used_at), list(used_at.values())
        async with self._tx() as conn:
            await conn.execute(
                "UPDATE herald_api_keys k SET last_used_at = greatest(coalesce(k.last_used_at, 0), u.at)"
                " FROM unnest($1::text[], $2::double precision[]) AS u(id, at) WHERE k.id = u.id", ids, times)

    async def audit_log(self, *, before: int | None, limit: int) -> list[AuditRow]:
        rows = await self._fetch("SELECT * FROM herald_audit WHERE seq < $1 ORDER BY seq DESC LIMIT $2",
                                 before if before is not None else 2**62, limit)
        return [AuditRow(id=str(r["seq"]), at=r["at"], action=r["action"], tenant=r["tenant"], key_id=r["key_id"],
                         detail=json.loads(r["detail"])) for r in rows]
