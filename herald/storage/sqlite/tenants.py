"""SQLite: tenants, API keys (hashes) and the admin audit log (``TenantStore``, SPEC §12)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from typing import Any

from herald.storage.sqlite.db import Database
from herald.tenants import (
    KEY_CREATED, KEY_REVOKED, SOURCE_API, TENANT_CREATED, TENANT_DISABLED, TENANT_UPDATED,
    AuditRow, DirectorySnapshot, KeyRow, TenantRow, merged_limits,
)
from herald.timefmt import now

# The tables: sql/0003_tenants.sql beside this package's schema.py.

_KEY_COLUMNS = "id, tenant, name, scopes, digest, created_at, expires_at, last_used_at"


def _tenant(row: sqlite3.Row) -> TenantRow:
    return TenantRow(id=row["id"], created_at=row["created_at"], disabled=bool(row["disabled"]),
                     limits=json.loads(row["limits"]), source=row["source"])


def _key(row: sqlite3.Row) -> KeyRow:
    return KeyRow(id=row["id"], tenant=row["tenant"], name=row["name"], scopes=tuple(row["scopes"].split(",")),
                  digest=bytes(row["digest"]), created_at=row["created_at"], expires_at=row["expires_at"],
                  last_used_at=row["last_used_at"])


def _changed(conn: sqlite3.Connection, at: float, action: str, tenant: str | None, key_id: str | None,
             detail: Mapping[str, Any]) -> None:
    """The audit row and the version bump every change makes, in the change's transaction."""
    conn.execute("INSERT INTO herald_audit (at, action, tenant, key_id, detail) VALUES (?,?,?,?,?)",
                 (at, action, tenant, key_id, json.dumps(detail, sort_keys=True)))
    conn.execute("UPDATE herald_directory SET version = version + 1 WHERE id = 1")


class SqliteTenantStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def directory_version(self) -> int:
        return int(self._db.read("SELECT version FROM herald_directory WHERE id = 1")[0][0])

    async def snapshot(self) -> DirectorySnapshot:
        def read(conn: sqlite3.Connection) -> DirectorySnapshot:
            # One read transaction: the version and the rows it covers agree.
            conn.execute("BEGIN")
            try:
                version = int(conn.execute("SELECT version FROM herald_directory WHERE id = 1").fetchone()[0])
                tenants = [_tenant(r) for r in conn.execute("SELECT * FROM herald_tenants")]
                keys = [_key(r) for r in conn.execute(
                    f"SELECT {_KEY_COLUMNS} FROM herald_api_keys WHERE revoked_at IS NULL")]
            finally:
                conn.execute("COMMIT")
            return DirectorySnapshot(version=version, tenants=tenants, keys=keys)

        return await self._db.read_in_thread(read)

    async def create_tenant(self, tenant_id: str, limits: Mapping[str, float], *, source: str = SOURCE_API,
                            disabled: bool = False) -> TenantRow | None:
        def tx(conn: sqlite3.Connection) -> TenantRow | None:
            at = now()
            cursor = conn.execute(
                "INSERT OR IGNORE INTO herald_tenants (id, created_at, disabled, source, limits) VALUES (?,?,?,?,?)",
                (tenant_id, at, int(disabled), source, json.dumps(dict(limits), sort_keys=True)))
            if cursor.rowcount == 0:
                return None
            _changed(conn, at, TENANT_CREATED, tenant_id, None, {"limits": dict(limits), "source": source})
            return TenantRow(id=tenant_id, created_at=at, disabled=disabled, limits=dict(limits), source=source)

        return await self._db.write(tx)

    async def get_tenant(self, tenant_id: str) -> TenantRow | None:
        rows = self._db.read("SELECT * FROM herald_tenants WHERE id = ?", (tenant_id,))
        return _tenant(rows[0]) if rows else None

    async def list_tenants(self, *, after: str | None, limit: int) -> list[TenantRow]:
        rows = self._db.read("SELECT * FROM herald_tenants WHERE id > ? ORDER BY id LIMIT ?", (after or "", limit))
        return [_tenant(r) for r in rows]

    async def update_tenant(self, tenant_id: str, *, limits: Mapping[str, float | None] | None,
                            disabled: bool | None, source_if_new: str | None = None) -> TenantRow | None:
        def tx(conn: sqlite3.Connection) -> TenantRow | None:
            at = now()
            if source_if_new is not None:  # no audit row of its own: the change below has one
                conn.execute("INSERT OR IGNORE INTO herald_tenants (id, created_at, disabled, source, limits)"
                             " VALUES (?,?,0,?,'{}')", (tenant_id, at, source_if_new))
            row = conn.execute("SELECT * FROM herald_tenants WHERE id = ?", (tenant_id,)).fetchone()
            if row is None:
                return None
            current = _tenant(row)
            merged = merged_limits(current.limits, limits)
            now_disabled = current.disabled if disabled is None else disabled
            conn.execute("UPDATE herald_tenants SET limits = ?, disabled = ? WHERE id = ?",
                         (json.dumps(merged, sort_keys=True), int(now_disabled), tenant_id))
            if limits is not None:
                _changed(conn, at, TENANT_UPDATED, tenant_id, None, {"limits": dict(limits)})
            if disabled is not None and disabled != current.disabled:
                action = TENANT_DISABLED if disabled else TENANT_UPDATED
                _changed(conn, at, action, tenant_id, None, {"disabled": disabled})
            return TenantRow(id=tenant_id, created_at=current.created_at, disabled=now_disabled, limits=merged,
                             source=current.source)

        return await self._db.write(tx)

    async def create_key(self, key: KeyRow) -> KeyRow:
        def tx(conn: sqlite3.Connection) -> KeyRow:
            at = now()
            conn.execute(
                "INSERT INTO herald_api_keys (id, tenant, name, scopes, digest, created_at, expires_at)"
                " VALUES (?,?,?,?,?,?,?)",
                (key.id, key.tenant, key.name, ",".join(key.scopes), key.digest, at, key.expires_at))
            _changed(conn, at, KEY_CREATED, key.tenant, key.id, {"name": key.name, "scopes": list(key.scopes)})
            return KeyRow(id=key.id, tenant=key.tenant, name=key.name, scopes=key.scopes, digest=key.digest,
                          created_at=at, expires_at=key.expires_at)

        return await self._db.write(tx)

    async def list_keys(self, tenant_id: str) -> list[KeyRow]:
        rows = self._db.read(f"SELECT {_KEY_COLUMNS} FROM herald_api_keys WHERE tenant = ? AND revoked_at IS NULL"
                             " ORDER BY created_at, id", (tenant_id,))
        return [_key(r) for r in rows]

    async def get_key(self, key_id: str) -> KeyRow | None:
        rows = self._db.read(f"SELECT {_KEY_COLUMNS} FROM herald_api_keys WHERE id = ? AND revoked_at IS NULL",
                             (key_id,))
        return _key(rows[0]) if rows else None

    async def revoke_key(self, key_id: str) -> KeyRow | None:
        def tx(conn: sqlite3.Connection) -> KeyRow | None:
            row = conn.execute(f"SELECT {_KEY_COLUMNS} FROM herald_api_keys WHERE id = ? AND revoked_at IS NULL",
                               (key_id,)).fetchone()
            if row is None:
                return None
            at = now()
            conn.execute("UPDATE herald_api_keys SET revoked_at = ? WHERE id = ?", (at, key_id))
            key = _key(row)
            _changed(conn, at, KEY_REVOKED, key.tenant, key.id, key.revoked_detail())
            return key

        return await self._db.write(tx)

    async def touch_keys(self, used_at: Mapping[str, float]) -> None:
        if not used_at:
            return

        def tx(conn: sqlite3.Connection) -> None:
            # Not a directory change: no version bump, no audit row.
            conn.executemany(
                "UPDATE herald_api_keys SET last_used_at = max(coalesce(last_used_at, 0), ?) WHERE id = ?",
                [(at, key_id) for key_id, at in used_at.items()])

        await self._db.write(tx)

    async def audit_log(self, *, before: int | None, limit: int) -> list[AuditRow]:
        rows = self._db.read("SELECT * FROM herald_audit WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                             (before if before is not None else 2**62, limit))
        return [AuditRow(id=str(r["seq"]), at=r["at"], action=r["action"], tenant=r["tenant"], key_id=r["key_id"],
                         detail=json.loads(r["detail"])) for r in rows]
