"""Webhook tables in the job store's SQLite file: endpoints, signing keys, deliveries, attempts.

The SQLite ``WebhookStore`` (``herald.storage.ports``). The gateway (the endpoints API)
and every notifier process use these tables through the same ``Database`` as the job
store, so each method below is one transaction on the writer thread, or one indexed
read on the loop. The delivery queue (fan-out, claiming, outcomes) is in ``queue``.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from herald.deliveries import (
    TEST_EVENT_TYPE,
    TEST_EVENT_WINDOW_S,
    TEST_EVENTS_PER_WINDOW,
    TEST_JOB_END,
    TEST_JOB_PREFIX,
    AttemptRow,
    DeliveryRow,
    EndpointLimitReached,
    EndpointRow,
    HealthRow,
    TestEventsLimited,
    callback_owner,
)
from herald import delivery_rules as rules
from herald.ids import new_id
from herald.sealing import Sealer, key_aad
from herald.storage.sqlite.db import Database
from herald.timefmt import now
from herald.webhook_signing import HMAC, SigningKey, new_key

DELETE_BATCH = 500  # deliveries per write transaction when an endpoint is deleted (delete_endpoint)

# The tables: sql/0002_webhooks.sql beside this package's schema.py.


def _encode_list(values: Iterable[str] | None) -> str | None:
    return None if values is None else msgspec.json.encode(list(values)).decode()


def _key_from_row(row: sqlite3.Row, sealer: Sealer) -> SigningKey:
    public_key = bytes(row["public_key"]) if row["public_key"] is not None else None
    secret = sealer.open(row["secret"], key_aad(row["owner"], row["algorithm"], public_key))
    return SigningKey(algorithm=row["algorithm"], secret=secret, public_key=public_key)


def _times(row: sqlite3.Row) -> rules.KeyTimes:
    return rules.KeyTimes(created_at=row["created_at"], retire_at=row["retire_at"])


def live_keys(conn: sqlite3.Connection, owner: str, at: float, sealer: Sealer) -> list[SigningKey]:
    """The keys that sign now (``delivery_rules.signing_keys``): the current one first, then any
    in their overlap. An owner has a few rows at most: rotation forgets the retired ones."""
    rows = conn.execute("SELECT * FROM webhook_keys WHERE owner = ?", (owner,)).fetchall()
    return [_key_from_row(r, sealer) for r in rules.signing_keys(((_times(r), r) for r in rows), at)]


def add_key(conn: sqlite3.Connection, owner: str, algorithm: str, at: float, sealer: Sealer) -> SigningKey:
    """A new current key, as ``delivery_rules.rotate`` says: the previous current key keeps
    signing for the overlap, then retires."""
    rows = conn.execute("SELECT created_at, retire_at FROM webhook_keys WHERE owner = ?", (owner,)).fetchall()
    rotation = rules.rotate([_times(r) for r in rows], at)
    conn.executemany("DELETE FROM webhook_keys WHERE owner = ? AND created_at = ?",
                     [(owner, t) for t in rotation.forget])
    conn.executemany("UPDATE webhook_keys SET retire_at = ? WHERE owner = ? AND created_at = ?",
                     [(rotation.retire_at, owner, t) for t in rotation.retire])
    key = new_key(algorithm)
    conn.execute(
        "INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key) VALUES (?,?,?,?,?)",
        (owner, rotation.created_at, key.algorithm,
         sealer.seal(key.secret, key_aad(owner, key.algorithm, key.public_key)), key.public_key),
    )
    return key


def fail_pending(conn: sqlite3.Connection, endpoint_id: str, at: float, *, sparing: str = "") -> None:
    """An endpoint was disabled: its waiting deliveries end ``failed`` (and are not sent), as
    ``delivery_rules.fails_with_its_endpoint`` says; those out now are their attempts' to settle,
    and so is ``sparing``, the delivery whose attempt disabled it (settled by its caller)."""
    rows = conn.execute("SELECT id, status, lease_until FROM webhook_deliveries"
                        " WHERE endpoint_id = ? AND status = 'pending' AND id != ?", (endpoint_id, sparing)).fetchall()
    _fail(conn, [r["id"] for r in rows if rules.fails_with_its_endpoint(r["status"], r["lease_until"], at)], at)


def fail_orphans(conn: sqlite3.Connection, at: float, limit: int) -> int:
    """Pending deliveries of disabled endpoints that are no longer out (their attempt's notifier
    died, or handed the lease back unrecorded): failed, as disabling would have (at most ``limit``)."""
    rows = conn.execute(
        "SELECT d.id, d.status, d.lease_until FROM webhook_endpoints e"
        " JOIN webhook_deliveries d ON d.endpoint_id = e.id AND d.status = 'pending'"
        " WHERE e.status = 'disabled' AND (d.lease_until IS NULL OR d.lease_until <= ?) LIMIT ?",
        (at, limit)).fetchall()
    ids = [r["id"] for r in rows if rules.fails_with_its_endpoint(r["status"], r["lease_until"], at)]
    _fail(conn, ids, at)
    return len(ids)


def _fail(conn: sqlite3.Connection, delivery_ids: Sequence[str], at: float) -> None:
    conn.executemany(
        "UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,"
        " lease_until = NULL, updated_at = ? WHERE id = ? AND status = 'pending'",
        [(at, delivery_id) for delivery_id in delivery_ids])


class SqliteWebhookStore:
    """Endpoints, keys and the delivery log as the API sees them. One per process."""

    def __init__(self, db: Database, sealer: Sealer) -> None:
        self.db = db
        self.sealer = sealer

    # ----- endpoints ----------------------------------------------------------------

    async def create_endpoint(
        self, tenant: str, *, url: str, event_types: Sequence[str], kinds: Sequence[str] | None, signature: str,
        max_endpoints: int | None = None,
    ) -> tuple[EndpointRow, SigningKey]:
        endpoint_id = str(uuid.uuid4())

        def tx(conn: sqlite3.Connection) -> tuple[EndpointRow, SigningKey]:
            ts = now()
            if max_endpoints is not None:  # counted in the writing transaction: two creations cannot both pass
                (count,) = conn.execute("SELECT COUNT(*) FROM webhook_endpoints WHERE tenant = ?", (tenant,)).fetchone()
                if count >= max_endpoints:
                    raise EndpointLimitReached(max_endpoints)
            conn.execute(
                "INSERT INTO webhook_endpoints (id, tenant, url, event_types, kinds, signature, status,"
                " created_at, updated_at) VALUES (?,?,?,?,?,?, 'enabled', ?, ?)",
                (endpoint_id, tenant, url, _encode_list(event_types), _encode_list(kinds), signature, ts, ts),
            )
            key = add_key(conn, endpoint_id, signature, ts, self.sealer)
            row = conn.execute("SELECT * FROM webhook_endpoints WHERE id = ?", (endpoint_id,)).fetchone()
            return EndpointRow.from_mapping(row), key

        return await self.db.write(tx)

    async def get_endpoint(self, tenant: str, endpoint_id: str) -> EndpointRow | None:
        rows = self.db.read("SELECT * FROM webhook_endpoints WHERE id = ? AND tenant = ?", (endpoint_id, tenant))
        return EndpointRow.from_mapping(rows[0]) if rows else None

    async def list_endpoints(self, tenant: str, *, before: tuple[float, str] | None, limit: int) -> list[EndpointRow]:
        sql = "SELECT * FROM webhook_endpoints WHERE tenant = ?"
        params: list[Any] = [tenant]
        if before is not None:
            sql += " AND (created_at < ? OR (created_at = ? AND id < ?))"
            params += [before[0], before[0], before[1]]
        rows = self.db.read(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", [*params, limit])
        return [EndpointRow.from_mapping(r) for r in rows]

    async def update_endpoint(self, tenant: str, endpoint_id: str, changes: Mapping[str, Any]) -> EndpointRow | None:
        """Apply ``changes`` (url, event_types, kinds, status). Disabling fails what was waiting."""

        def tx(conn: sqlite3.Connection) -> EndpointRow | None:
            ts = now()
            found = conn.execute("SELECT status FROM webhook_endpoints WHERE id = ? AND tenant = ?",
                                 (endpoint_id, tenant)).fetchone()
            if not found:
                return None
            values: dict[str, Any] = {"updated_at": ts}
            for name in ("url", "status"):
                if name in changes:
                    values[name] = changes[name]
            for name in ("event_types", "kinds"):
                if name in changes:
                    values[name] = _encode_list(changes[name])
            if changes.get("status") == "enabled" and found["status"] != "enabled":
                # Re-enabled: a fresh start, the 5-day clock restarts. Enabling an enabled
                # endpoint changes nothing (its failing streak goes on).
                values["failing_since"] = None
            assignments = ", ".join(f"{column} = ?" for column in values)
            conn.execute(f"UPDATE webhook_endpoints SET {assignments} WHERE id = ?", (*values.values(), endpoint_id))
            if changes.get("status") == "disabled":
                fail_pending(conn, endpoint_id, ts)
            return EndpointRow.from_mapping(conn.execute("SELECT * FROM webhook_endpoints WHERE id = ?",
                                                     (endpoint_id,)).fetchone())

        return await self.db.write(tx)

    async def delete_endpoint(self, tenant: str, endpoint_id: str) -> bool:
        """The endpoint, its keys, its deliveries and their attempts.

        SQLite has one writer for every tenant, and an endpoint's delivery log can be long (a
        paced target's deliveries stay pending): deleted in one transaction, 16 000 deliveries
        held every tenant's writes for 5 s. So the endpoint stops taking deliveries first
        (disabled: no fan-out adds to it, no claim takes from it), its log goes a bounded batch
        per transaction, and the endpoint and its keys last. Interrupted, it is left disabled
        with part of its log, and deleting it again finishes the job."""

        def disable(conn: sqlite3.Connection) -> bool:
            found = conn.execute("UPDATE webhook_endpoints SET status = 'disabled' WHERE id = ? AND tenant = ?",
                                 (endpoint_id, tenant))
            return bool(found.rowcount)

        def delete_batch(conn: sqlite3.Connection) -> int:
            ids = [(row[0],) for row in conn.execute(
                "SELECT id FROM webhook_deliveries WHERE endpoint_id = ? LIMIT ?", (endpoint_id, DELETE_BATCH))]
            conn.executemany("DELETE FROM webhook_attempts WHERE delivery_id = ?", ids)
            conn.executemany("DELETE FROM webhook_deliveries WHERE id = ?", ids)
            return len(ids)

        def delete_rest(conn: sqlite3.Connection) -> bool:
            deleted = conn.execute("DELETE FROM webhook_endpoints WHERE id = ? AND tenant = ?", (endpoint_id, tenant))
            if not deleted.rowcount:
                return False
            conn.execute("DELETE FROM webhook_keys WHERE owner = ?", (endpoint_id,))
            delete_batch(conn)  # what an attempt ending meanwhile left: a few rows at most
            return True

        if not await self.db.write(disable):
            return False
        while await self.db.write(delete_batch) == DELETE_BATCH:
            pass
        return await self.db.write(delete_rest)

    async def rotate_endpoint_key(self, tenant: str, endpoint_id: str) -> SigningKey | None:
        def tx(conn: sqlite3.Connection) -> SigningKey | None:
            row = conn.execute("SELECT signature FROM webhook_endpoints WHERE id = ? AND tenant = ?",
                               (endpoint_id, tenant)).fetchone()
            return add_key(conn, endpoint_id, row["signature"], now(), self.sealer) if row else None

        return await self.db.write(tx)

    # ----- the tenant's callback secret ---------------------------------------------------

    async def callback_key(self, tenant: str) -> SigningKey:
        """The current callback secret, created on first use."""

        def tx(conn: sqlite3.Connection) -> SigningKey:
            return current_callback_key(conn, tenant, now(), self.sealer)

        rows = self.db.read(
            "SELECT * FROM webhook_keys WHERE owner = ? AND retire_at IS NULL ORDER BY created_at DESC LIMIT 1",
            (callback_owner(tenant),),
        )
        return _key_from_row(rows[0], self.sealer) if rows else await self.db.write(tx)

    async def rotate_callback_key(self, tenant: str) -> SigningKey:
        def tx(conn: sqlite3.Connection) -> SigningKey:
            return add_key(conn, callback_owner(tenant), HMAC, now(), self.sealer)

        return await self.db.write(tx)

    # ----- the delivery log ----------------------------------------------------------------

    async def list_deliveries(
        self, endpoint_id: str, *, status: str | None, before_seq: int | None, limit: int
    ) -> list[DeliveryRow]:
        """Newest first. The caller has already checked that the endpoint is the tenant's."""
        sql = "SELECT * FROM webhook_deliveries WHERE endpoint_id = ?"
        params: list[Any] = [endpoint_id]
        if status is not None:
            sql += " AND status = ?"
            params.append(status)
        if before_seq is not None:
            sql += " AND seq < ?"
            params.append(before_seq)
        rows = self.db.read(sql + " ORDER BY seq DESC LIMIT ?", [*params, limit])
        return [DeliveryRow.from_mapping(r) for r in rows]

    async def attempts(self, delivery_ids: Sequence[str]) -> dict[str, list[AttemptRow]]:
        found: dict[str, list[AttemptRow]] = {d: [] for d in delivery_ids}
        if not delivery_ids:
            return found
        marks = ",".join("?" * len(delivery_ids))
        rows = self.db.read(f"SELECT * FROM webhook_attempts WHERE delivery_id IN ({marks}) ORDER BY delivery_id, n",
                            list(delivery_ids))
        for r in rows:
            found[r["delivery_id"]].append(AttemptRow(n=r["n"], at=r["at"], status_code=r["status_code"],
                                                      latency_ms=r["latency_ms"], error=r["error"],
                                                      response=r["response"]))
        return found

    async def get_delivery(self, endpoint_id: str, delivery_id: str) -> DeliveryRow | None:
        rows = self.db.read("SELECT * FROM webhook_deliveries WHERE id = ? AND endpoint_id = ?",
                            (delivery_id, endpoint_id))
        return DeliveryRow.from_mapping(rows[0]) if rows else None

    async def retry_now(self, endpoint_id: str, delivery_id: str) -> DeliveryRow | None:
        """Make the delivery due now, whatever its status; it keeps its id and webhook-id. One in
        flight keeps the request for its attempt's record (``delivery_rules.retry_kept``)."""

        def tx(conn: sqlite3.Connection) -> DeliveryRow | None:
            ts = now()
            found = conn.execute("SELECT lease_until FROM webhook_deliveries WHERE id = ? AND endpoint_id = ?",
                                 (delivery_id, endpoint_id)).fetchone()
            if found is None:
                return None
            asked = ts if rules.retry_kept(found["lease_until"], ts) else None
            conn.execute(
                "UPDATE webhook_deliveries SET status = 'pending', next_attempt_at = ?, retry_asked_at = ?,"
                " updated_at = ? WHERE id = ?",
                (ts, asked, ts, delivery_id),
            )
            row = conn.execute("SELECT * FROM webhook_deliveries WHERE id = ?", (delivery_id,)).fetchone()
            return DeliveryRow.from_mapping(row)

        return await self.db.write(tx)

    async def recover(self, tenant: str, endpoint_id: str, since: float) -> int:
        """Every failed delivery created since ``since`` due now (one transaction: the writer lock)."""

        def tx(conn: sqlite3.Connection) -> int:
            ts = now()
            if not conn.execute("SELECT 1 FROM webhook_endpoints WHERE id = ? AND tenant = ? AND status = 'enabled'",
                                (endpoint_id, tenant)).fetchone():
                return 0
            return conn.execute(
                "UPDATE webhook_deliveries SET status = 'pending', next_attempt_at = ?, updated_at = ?"
                " WHERE endpoint_id = ? AND status = 'failed' AND created_at >= ?",
                (ts, ts, endpoint_id, since),
            ).rowcount

        return await self.db.write(tx)

    async def add_test_delivery(self, tenant: str, endpoint_id: str, event_id: str, job_key: str,
                                body: bytes) -> DeliveryRow | None:
        """One webhook.test delivery, due now, through the same queue as every other."""

        def tx(conn: sqlite3.Connection) -> DeliveryRow | None:
            ts = now()
            if not conn.execute("SELECT 1 FROM webhook_endpoints WHERE id = ? AND tenant = ? AND status = 'enabled'",
                                (endpoint_id, tenant)).fetchone():
                return None
            # webhook.test deliveries are the endpoint's job ids "test:..." (a range of its order index)
            recent = [r[0] for r in conn.execute(
                "SELECT created_at FROM webhook_deliveries WHERE target = ? AND job_id >= ? AND job_id < ?"
                " AND created_at > ? ORDER BY created_at",
                (endpoint_id, TEST_JOB_PREFIX, TEST_JOB_END, ts - TEST_EVENT_WINDOW_S))]
            if len(recent) >= TEST_EVENTS_PER_WINDOW:
                raise TestEventsLimited(recent[-TEST_EVENTS_PER_WINDOW] + TEST_EVENT_WINDOW_S - ts)
            conn.execute("INSERT INTO webhook_messages (event_id, body, created_at) VALUES (?,?,?)",
                         (event_id, body, ts))
            delivery_id = new_id()
            conn.execute(
                "INSERT INTO webhook_deliveries (id, tenant, target, endpoint_id, url, event_id, job_id, version, type,"
                " status, scheduled_at, next_attempt_at, created_at, updated_at)"
                " VALUES (?,?,?,?,NULL,?,?,0,?,'pending',?,?,?,?)",
                (delivery_id, tenant, endpoint_id, endpoint_id, event_id, job_key, TEST_EVENT_TYPE, ts, ts, ts, ts),
            )
            row = conn.execute("SELECT * FROM webhook_deliveries WHERE id = ?", (delivery_id,)).fetchone()
            return DeliveryRow.from_mapping(row)

        return await self.db.write(tx)

    async def messages(self, event_ids: Sequence[str]) -> dict[str, bytes]:
        if not event_ids:
            return {}
        marks = ",".join("?" * len(event_ids))
        rows = self.db.read(f"SELECT event_id, body FROM webhook_messages WHERE event_id IN ({marks})",
                            list(event_ids))
        return {r["event_id"]: bytes(r["body"]) for r in rows}

    async def endpoint_health(self, endpoint_ids: Sequence[str], window: int) -> dict[str, HealthRow]:
        found: dict[str, HealthRow] = {}
        for endpoint_id in endpoint_ids:  # each an index range scan of at most ``window`` rows
            rows = self.db.read(
                "SELECT * FROM webhook_deliveries WHERE endpoint_id = ? ORDER BY seq DESC LIMIT ?",
                (endpoint_id, window))
            statuses = [r["status"] for r in rows]
            found[endpoint_id] = HealthRow(delivered=statuses.count("delivered"), failed=statuses.count("failed"),
                                           last=DeliveryRow.from_mapping(rows[0]) if rows else None)
        return found


def current_callback_key(conn: sqlite3.Connection, tenant: str, at: float, sealer: Sealer) -> SigningKey:
    owner = callback_owner(tenant)
    row = conn.execute(
        "SELECT * FROM webhook_keys WHERE owner = ? AND retire_at IS NULL ORDER BY created_at DESC LIMIT 1", (owner,)
    ).fetchone()
    return _key_from_row(row, sealer) if row else add_key(conn, owner, HMAC, at, sealer)
