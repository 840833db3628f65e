"""Webhook endpoints, signing keys and the delivery queue in PostgreSQL.

The decisions are ``herald.delivery_rules``' (the rulebook both stores keep): the plpgsql
functions (``sql/functions/webhooks_*.sql``) make them next to the data, with the rulebook's numbers passed in as
arguments (``tests/store_contract/test_rulebook.py`` checks them against the rulebook, case by
case); key rotation, a rare API write, calls the rulebook itself. What this module
adds is how it stays correct without SQLite's single writer, when several gateways and
notifiers on several machines use the same tables at once.

Clock. Every time is ``clock_timestamp()`` of the server, in Unix seconds, so leases
and retry times are judged by one clock. Inside SQL it is read once per statement into a
variable or an uncorrelated sub-select, so that it stays a constant the planner can use
against the indexes (a bare volatile call per row could not be).

Round trips. The hot paths are one statement each, one round trip: ``fan_out``, ``claim``,
``fan_out_leasing`` (the two in one transaction) and ``finish`` call plpgsql functions
(``sql/functions/webhooks_*.sql``), so their several steps run next to the data instead of a
BEGIN, n statements and a COMMIT over the network.
A plpgsql function in READ COMMITTED also takes a fresh snapshot per statement, which
the claim below depends on. The API's rarer writes (update, delete, rotate) are short
explicit transactions.

Plans. plpgsql caches a generic plan per statement after a few calls, and one made while
the tables were nearly empty (a new deployment, before autovacuum's first ANALYZE) would
keep scanning them as they grow. Every statement of fan-out, finish and the claim is an
index probe by design, so those functions run with ``enable_seqscan = off``. The claim's
fairness (caps per tenant and per target, from the caller's counts) is applied in plpgsql
between simple probes rather than inside one large query: a query shaped by those counts
would have to be planned afresh each call, 1.5-3 ms a call (bench/RESULTS.md).

Concurrency, and why each lock is there:

* **Claims never overlap.** ``herald_webhook_claim`` picks candidates per target as the
  SQLite version does (per-target cap, oldest first, nothing whose older version of the
  same job is pending for the same target: a LATERAL scan of each target's pending index
  range), locks them in an outer step with ``FOR UPDATE SKIP LOCKED``, and writes the
  lease in a second statement. Rows another notifier holds are skipped, and a
  row it leased meanwhile is re-checked on its newest version and dropped.
* **Order per job and target survives concurrent fan-out.** Two notifiers can fan out v1
  and v2 of one job at the same moment, or v1 while another claims v2. So fan-out takes a
  transaction-scoped advisory lock per (target, job) -- all of them up front, sorted, so
  fan-outs cannot deadlock each other -- and then locks the newer rows of that job and
  target ``FOR UPDATE`` before deciding whether the older event is superseded. The claim
  re-checks the ordering rule after taking its row locks (second statement, newer
  snapshot), so an older delivery committed meanwhile holds the newer one back. ``finish``
  takes the same advisory lock, so its "a newer version exists: superseded" check sees a
  fan-out that ran meanwhile, two finishes of one delivery number attempts in turn, and a
  finish recorded again (the same ``Attempted.id``, the answer to the first lost) finds the
  first one's row and writes nothing. ``finish_many`` (the
  attempts one notifier saw finish together, in one transaction) takes all its order
  locks first, sorted as fan-out's are.
* **Endpoints deleted or disabled meanwhile.** Fan-out holds the matching endpoints
  ``FOR KEY SHARE`` (which ordinary updates such as ``failing_since`` do not wait for);
  deleting or disabling an endpoint through the API first takes its row ``FOR UPDATE``,
  waiting for fan-outs in flight, then fails or deletes its deliveries in a later
  statement that sees theirs.
* **One current key per owner.** Rotation and create-on-first-use run under an advisory
  lock per key owner, and a partial unique index keeps at most one un-retired key.
* Rare lock cycles (an endpoint disabled by ``finish`` while fan-outs touch its
  deliveries) are resolved by PostgreSQL's deadlock detector; the transactions involved
  are idempotent and retried here.

Schema notes: ``event_types``/``kinds`` are ``TEXT[]``; message bodies are stored once per
event (``webhook_messages``); ``UNIQUE (event_id, target)`` is both the idempotency key of
fan-out and the index that pruning orphaned messages probes.

What callers can see differ from SQLite is stated in ``herald.storage.ports`` (a claim may
return fewer than ``limit`` while another notifier holds the rest).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import asyncpg
import msgspec

from herald.deliveries import (
    DUE_PROBE_ROWS,
    Attempted,
    TEST_EVENT_TYPE,
    TEST_EVENT_WINDOW_S,
    TEST_EVENTS_PER_WINDOW,
    TEST_JOB_END,
    TEST_JOB_PREFIX,
    AttemptRow,
    Claimed,
    DeliveryRow,
    EndpointLimitReached,
    EndpointRow,
    Drained,
    FannedOut,
    Finished,
    HealthRow,
    LeaseOffer,
    Outcome,
    Plan,
    TestEventsLimited,
    callback_owner,
    event_id,
    new_attempt_id,
)
from herald import delivery_rules as rules
from herald.delivery_rules import (
    DRAIN_TENANTS,
    ENDPOINT_DISABLE_AFTER_S,
    FAN_OUT_BATCH,
    FAN_OUT_SHARE,
    PROGRESS_INTERVAL_S,
    RESPONSE_KEEP_BYTES,
)
from herald.sealing import Sealer, key_aad
from herald.storage.postgres.db import NOW_SQL, PgDatabase, unavailable_on_connection_errors
from herald.webhook_signing import HMAC, SigningKey, new_key
from schemas import JobEvent
from schemas.webhooks import WebhookPayload

T = TypeVar("T")

# Advisory lock classes (two-int form, a key space apart from the bigint locks of the
# migrations and the job store): "WHOR" orders deliveries per (target, job), "WHKY"
# serialises an owner's key changes.
ORDER_LOCK_CLASS = 0x57484F52
KEY_LOCK_CLASS = 0x57484B59
ENDPOINT_LOCK_CLASS = 0x57484550  # "WHEP": a tenant's endpoint count (max_endpoints)
SHARE_LOCK_CLASS = 0x57485348  # "WHSH": a tenant's fan-out share: its first events put to wait
DRAIN_LOCK_CLASS = 0x57484452  # "WHDR": a tenant's waiting events, drained by one notifier at a time

# The server's clock once per statement: an InitPlan, a constant for index scans.
NOW = f"(SELECT {NOW_SQL})"

# The tables: sql/0006-0012 beside this package's schema.py; the functions: sql/functions/webhooks_*.sql.

# An endpoint was disabled: its deliveries that wait fail (``delivery_rules.fails_with_its_endpoint``);
# those out now are their attempts' to settle (``herald_webhook_finish``).
_FAIL_PENDING_SQL = f"""
UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
       lease_until = NULL, updated_at = {NOW}
 WHERE endpoint_id = $1 AND status = 'pending' AND (lease_until IS NULL OR lease_until <= {NOW})
"""

_LIVE_KEYS_SQL = f"""
SELECT algorithm, secret, public_key FROM webhook_keys
 WHERE owner = $1 AND (retire_at IS NULL OR retire_at > {NOW}) ORDER BY created_at DESC
"""

_DEADLOCK_RETRIES = 5
_RETRIED_ERRORS = (asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.SerializationError)

_payload_encoder = msgspec.json.Encoder()


def _fan_out_args(events: Sequence[JobEvent]) -> tuple[Any, ...]:
    """``herald_webhook_fan_out``'s arguments: the events column by column."""
    return (
        [e.tenant for e in events], [e.job_id for e in events], [e.version for e in events],
        [e.type for e in events], [e.kind for e in events], [event_id(e) for e in events],
        [_payload_encoder.encode(WebhookPayload(type=e.type, timestamp=e.at, data=e.data)) for e in events],
        PROGRESS_INTERVAL_S, FAN_OUT_SHARE, FAN_OUT_BATCH,
    )


async def _retrying(attempt: Callable[[], Awaitable[T]]) -> T:
    """Run an idempotent transaction again if PostgreSQL broke a lock cycle by aborting it."""
    for n in range(_DEADLOCK_RETRIES):
        try:
            return await attempt()
        except _RETRIED_ERRORS:
            if n == _DEADLOCK_RETRIES - 1:
                raise
            await asyncio.sleep(0.01 * (n + 1))
    raise AssertionError("unreachable")


def _key(sealer: Sealer, owner: str, algorithm: str, secret: bytes, public_key: bytes | None) -> SigningKey:
    """A stored key, its secret opened (the SQL moves sealed bytes only)."""
    public = bytes(public_key) if public_key is not None else None
    return SigningKey(algorithm=algorithm, secret=sealer.open(secret, key_aad(owner, algorithm, public)),
                      public_key=public)


def _sealed(sealer: Sealer, owner: str, key: SigningKey) -> bytes:
    return sealer.seal(key.secret, key_aad(owner, key.algorithm, key.public_key))


async def _ensure_current_key(db: PgDatabase, sealer: Sealer, owner: str, algorithm: str) -> SigningKey:
    """The owner's current key, made now if it has none; concurrent first calls agree on one."""
    async with db.pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", KEY_LOCK_CLASS, owner)
        row = await conn.fetchrow(
            "SELECT algorithm, secret, public_key FROM webhook_keys WHERE owner = $1 AND retire_at IS NULL", owner)
        if row is not None:
            return _key(sealer, owner, row["algorithm"], row["secret"], row["public_key"])
        return await _rotate(conn, sealer, owner, algorithm)


async def _add_key(conn: asyncpg.Connection, sealer: Sealer, owner: str, algorithm: str) -> SigningKey:
    """A new current key, inside the caller's transaction."""
    await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", KEY_LOCK_CLASS, owner)
    return await _rotate(conn, sealer, owner, algorithm)


async def _rotate(conn: asyncpg.Connection, sealer: Sealer, owner: str, algorithm: str) -> SigningKey:
    """What ``delivery_rules.rotate`` says, written: under the owner's key lock (taken by the
    caller, in its transaction), so that its changes never interleave with another's. A
    rare API write, so plain statements rather than a plpgsql function: the rule stays
    the rulebook's."""
    key = new_key(algorithm)  # an unknown scheme fails before anything is written
    at, created, retires = await conn.fetchrow(
        f"SELECT {NOW_SQL}, coalesce(array_agg(created_at), '{{}}'), coalesce(array_agg(retire_at), '{{}}')"
        " FROM webhook_keys WHERE owner = $1", owner)
    rotation = rules.rotate([rules.KeyTimes(c, r) for c, r in zip(created, retires, strict=True)], at)
    await conn.execute(
        """
        WITH forgotten AS (DELETE FROM webhook_keys WHERE owner = $1 AND created_at = ANY($2::DOUBLE PRECISION[]))
        UPDATE webhook_keys SET retire_at = $4 WHERE owner = $1 AND created_at = ANY($3::DOUBLE PRECISION[])
        """,
        owner, list(rotation.forget), list(rotation.retire), rotation.retire_at)
    # A statement of its own: the new current key must not meet the old one in the
    # one-current-key index before that one's retirement is written.
    await conn.execute(
        "INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key) VALUES ($1, $2, $3, $4, $5)",
        owner, rotation.created_at, key.algorithm, _sealed(sealer, owner, key), key.public_key)
    return key


@unavailable_on_connection_errors
class PgWebhookStore:
    """Endpoints, keys and the delivery log as the API sees them."""

    def __init__(self, db: PgDatabase, sealer: Sealer) -> None:
        self.db = db
        self.sealer = sealer

    # ----- endpoints ----------------------------------------------------------------

    async def create_endpoint(
        self, tenant: str, *, url: str, event_types: Sequence[str], kinds: Sequence[str] | None, signature: str,
        max_endpoints: int | None = None,
    ) -> tuple[EndpointRow, SigningKey]:
        endpoint_id = str(uuid.uuid4())
        key = new_key(signature)  # an unknown scheme fails before anything is written
        # One statement: the endpoint and its first key (nobody can have rotated it yet).
        insert = f"""
            WITH clock AS (SELECT {NOW_SQL} AS ts),
            endpoint AS (
                INSERT INTO webhook_endpoints (id, tenant, url, event_types, kinds, signature, status,
                                               created_at, updated_at)
                SELECT $1, $2, $3, $4, $5, $6, 'enabled', ts, ts FROM clock RETURNING *),
            first_key AS (
                INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)
                SELECT id, created_at, $7, $8, $9 FROM endpoint)
            SELECT * FROM endpoint
            """
        args = (endpoint_id, tenant, url, list(event_types), None if kinds is None else list(kinds), signature,
                key.algorithm, _sealed(self.sealer, endpoint_id, key), key.public_key)
        if max_endpoints is None:
            row = await self.db.pool.fetchrow(insert, *args)
        else:
            # The count and the insert under one lock per tenant, so that creations at several
            # gateways at once cannot pass the cap together; the insert, a later statement, sees
            # every endpoint committed before the lock was granted.
            async with self.db.pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", ENDPOINT_LOCK_CLASS, tenant)
                count = await conn.fetchval("SELECT count(*) FROM webhook_endpoints WHERE tenant = $1", tenant)
                if count >= max_endpoints:
                    raise EndpointLimitReached(max_endpoints)
                row = await conn.fetchrow(insert, *args)
        assert row is not None
        return EndpointRow.from_mapping(row), key

    async def get_endpoint(self, tenant: str, endpoint_id: str) -> EndpointRow | None:
        row = await self.db.pool.fetchrow("SELECT * FROM webhook_endpoints WHERE id = $1 AND tenant = $2",
                                          endpoint_id, tenant)
        return EndpointRow.from_mapping(row) if row is not None else None

    async def list_endpoints(self, tenant: str, *, before: tuple[float, str] | None, limit: int) -> list[EndpointRow]:
        if before is None:
            rows = await self.db.pool.fetch(
                "SELECT * FROM webhook_endpoints WHERE tenant = $1 ORDER BY created_at DESC, id DESC LIMIT $2",
                tenant, limit)
        else:
            rows = await self.db.pool.fetch(
                "SELECT * FROM webhook_endpoints WHERE tenant = $1 AND (created_at, id) < ($2, $3)"
                " ORDER BY created_at DESC, id DESC LIMIT $4",
                tenant, before[0], before[1], limit)
        return [EndpointRow.from_mapping(r) for r in rows]

    async def update_endpoint(self, tenant: str, endpoint_id: str, changes: Mapping[str, Any]) -> EndpointRow | None:
        """Apply url/event_types/kinds/status. Disabling fails what was waiting."""
        values: dict[str, Any] = {}
        for name in ("url", "status", "event_types", "kinds"):
            if name in changes:
                value = changes[name]
                values[name] = list(value) if name in ("event_types", "kinds") and value is not None else value
        # Re-enabled: a fresh start, the 5-day clock restarts. Enabling an enabled endpoint
        # changes nothing (its failing streak goes on).
        fresh_start = (["failing_since = CASE WHEN status = 'enabled' THEN failing_since END"]
                       if changes.get("status") == "enabled" else [])
        assignments = ", ".join([f"{column} = ${n}" for n, column in enumerate(values, start=2)]
                                + fresh_start + [f"updated_at = {NOW}"])
        disabling = changes.get("status") == "disabled"

        async def tx() -> EndpointRow | None:
            async with self.db.pool.acquire() as conn, conn.transaction():
                # FOR UPDATE waits for fan-outs holding the endpoint, so the failing below
                # (a later statement, a newer snapshot) also catches what they queued.
                if not await conn.fetchval("SELECT 1 FROM webhook_endpoints WHERE id = $1 AND tenant = $2 FOR UPDATE",
                                           endpoint_id, tenant):
                    return None
                row = await conn.fetchrow(f"UPDATE webhook_endpoints SET {assignments} WHERE id = $1 RETURNING *",
                                          endpoint_id, *values.values())
                if disabling:
                    await conn.execute(_FAIL_PENDING_SQL, endpoint_id)
                return EndpointRow.from_mapping(row)

        return await _retrying(tx)

    async def delete_endpoint(self, tenant: str, endpoint_id: str) -> bool:
        """The endpoint, its keys, its deliveries and their attempts go together."""

        async def tx() -> bool:
            async with self.db.pool.acquire() as conn, conn.transaction():
                # Waits for fan-outs holding the endpoint; the next statement sees their rows.
                if not await conn.fetchval("DELETE FROM webhook_endpoints WHERE id = $1 AND tenant = $2 RETURNING 1",
                                           endpoint_id, tenant):
                    return False
                await conn.execute(
                    """
                    WITH keys AS (DELETE FROM webhook_keys WHERE owner = $1),
                    deliveries AS (DELETE FROM webhook_deliveries WHERE endpoint_id = $1 RETURNING id)
                    DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM deliveries)
                    """,
                    endpoint_id)
                return True

        return await _retrying(tx)

    async def rotate_endpoint_key(self, tenant: str, endpoint_id: str) -> SigningKey | None:
        async with self.db.pool.acquire() as conn, conn.transaction():
            # Held against a concurrent delete, which would leave the new key orphaned.
            signature = await conn.fetchval(
                "SELECT signature FROM webhook_endpoints WHERE id = $1 AND tenant = $2 FOR KEY SHARE",
                endpoint_id, tenant)
            return await _add_key(conn, self.sealer, endpoint_id, signature) if signature is not None else None

    # ----- the tenant's callback secret ------------------------------------------------

    async def callback_key(self, tenant: str) -> SigningKey:
        """The current callback secret, created on first use."""
        owner = callback_owner(tenant)
        row = await self.db.pool.fetchrow(
            "SELECT algorithm, secret, public_key FROM webhook_keys WHERE owner = $1 AND retire_at IS NULL", owner)
        if row is not None:
            return _key(self.sealer, owner, row["algorithm"], row["secret"], row["public_key"])
        return await _ensure_current_key(self.db, self.sealer, owner, HMAC)

    async def rotate_callback_key(self, tenant: str) -> SigningKey:
        async with self.db.pool.acquire() as conn, conn.transaction():
            return await _add_key(conn, self.sealer, callback_owner(tenant), HMAC)

    # ----- the delivery log ----------------------------------------------------------------

    async def list_deliveries(
        self, endpoint_id: str, *, status: str | None, before_seq: int | None, limit: int
    ) -> list[DeliveryRow]:
        """Newest first. The caller has already checked that the endpoint is the tenant's."""
        rows = await self.db.pool.fetch(
            "SELECT * FROM webhook_deliveries WHERE endpoint_id = $1"
            " AND ($2::TEXT IS NULL OR status = $2) AND ($3::BIGINT IS NULL OR seq < $3)"
            " ORDER BY seq DESC LIMIT $4",
            endpoint_id, status, before_seq, limit)
        return [DeliveryRow.from_mapping(r) for r in rows]

    async def attempts(self, delivery_ids: Sequence[str]) -> dict[str, list[AttemptRow]]:
        found: dict[str, list[AttemptRow]] = {d: [] for d in delivery_ids}
        if not delivery_ids:
            return found
        rows = await self.db.pool.fetch(
            "SELECT * FROM webhook_attempts WHERE delivery_id = ANY($1::TEXT[]) ORDER BY delivery_id, n",
            list(delivery_ids))
        for r in rows:
            found[r["delivery_id"]].append(AttemptRow(
                n=r["n"], at=r["at"], status_code=r["status_code"], latency_ms=r["latency_ms"], error=r["error"],
                response=bytes(r["response"]) if r["response"] is not None else None))
        return found

    async def get_delivery(self, endpoint_id: str, delivery_id: str) -> DeliveryRow | None:
        row = await self.db.pool.fetchrow("SELECT * FROM webhook_deliveries WHERE id = $1 AND endpoint_id = $2",
                                          delivery_id, endpoint_id)
        return DeliveryRow.from_mapping(row) if row is not None else None

    async def retry_now(self, endpoint_id: str, delivery_id: str) -> DeliveryRow | None:
        """Make the delivery due now, whatever its status; it keeps its id and webhook-id. One in
        flight (leased: ``delivery_rules.retry_kept``) keeps the request for its attempt's record
        (``herald_webhook_finish``). The row's lock orders this with that record: a request made
        after the record finds the delivery no longer leased, and is simply due now."""
        row = await self.db.pool.fetchrow(
            f"""
            WITH clock AS (SELECT {NOW_SQL} AS ts)
            UPDATE webhook_deliveries SET status = 'pending', next_attempt_at = clock.ts, updated_at = clock.ts,
                   retry_asked_at = CASE WHEN lease_until > clock.ts THEN clock.ts END
              FROM clock WHERE id = $1 AND endpoint_id = $2 RETURNING webhook_deliveries.*
            """,
            delivery_id, endpoint_id)
        return DeliveryRow.from_mapping(row) if row is not None else None

    async def recover(self, tenant: str, endpoint_id: str, since: float) -> int:
        """Every failed delivery created since ``since`` due now, as ``retry_now`` does: one statement.

        The endpoint is held ``FOR KEY SHARE`` while enabled, as fan-out holds it, so a
        concurrent disable (which takes it ``FOR UPDATE`` first, then fails what is pending)
        either comes after and fails these again, or came before and this finds nothing.
        """
        count = await self.db.pool.fetchval(
            f"""
            WITH endpoint AS (
                SELECT id FROM webhook_endpoints WHERE id = $1 AND tenant = $2 AND status = 'enabled' FOR KEY SHARE),
            clock AS (SELECT {NOW_SQL} AS ts),
            recovered AS (
                UPDATE webhook_deliveries d SET status = 'pending', next_attempt_at = clock.ts, updated_at = clock.ts
                  FROM endpoint, clock
                 WHERE d.endpoint_id = endpoint.id AND d.status = 'failed' AND d.created_at >= $3
                RETURNING 1)
            SELECT count(*) FROM recovered
            """,
            endpoint_id, tenant, since)
        return int(count)

    async def add_test_delivery(self, tenant: str, endpoint_id: str, event_id: str, job_key: str,
                                body: bytes) -> DeliveryRow | None:
        """One webhook.test delivery, due now, the endpoint held as in ``recover``; at most
        ``TEST_EVENTS_PER_WINDOW`` per endpoint in ``TEST_EVENT_WINDOW_S`` (a lock per endpoint
        makes the count and the insert one step)."""
        async with self.db.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", ENDPOINT_LOCK_CLASS, endpoint_id)
            recent = [r[0] for r in await conn.fetch(
                f"""
                SELECT created_at FROM webhook_deliveries
                 WHERE target = $1 AND job_id >= $2 AND job_id < $3 AND created_at > {NOW_SQL} - $4
                 ORDER BY created_at
                """, endpoint_id, TEST_JOB_PREFIX, TEST_JOB_END, TEST_EVENT_WINDOW_S)]
            if len(recent) >= TEST_EVENTS_PER_WINDOW:
                ts = await conn.fetchval(f"SELECT {NOW_SQL}")
                raise TestEventsLimited(recent[-TEST_EVENTS_PER_WINDOW] + TEST_EVENT_WINDOW_S - ts)
            row = await conn.fetchrow(
                f"""
                WITH endpoint AS (
                    SELECT id FROM webhook_endpoints WHERE id = $1 AND tenant = $2 AND status = 'enabled' FOR KEY SHARE),
                clock AS (SELECT {NOW_SQL} AS ts),
                message AS (
                    INSERT INTO webhook_messages (event_id, body, created_at)
                    SELECT $3, $5, clock.ts FROM endpoint, clock)
                INSERT INTO webhook_deliveries (id, tenant, target, endpoint_id, url, event_id, job_id, version, type,
                                                status, scheduled_at, next_attempt_at, created_at, updated_at)
                SELECT herald_uuid7(), $2, endpoint.id, endpoint.id, NULL, $3, $4, 0, $6,
                       'pending', clock.ts, clock.ts, clock.ts, clock.ts
                  FROM endpoint, clock
                RETURNING *
                """,
                endpoint_id, tenant, event_id, job_key, body, TEST_EVENT_TYPE)
        return DeliveryRow.from_mapping(row) if row is not None else None

    async def messages(self, event_ids: Sequence[str]) -> dict[str, bytes]:
        if not event_ids:
            return {}
        rows = await self.db.pool.fetch(
            "SELECT event_id, body FROM webhook_messages WHERE event_id = ANY($1::TEXT[])", list(event_ids))
        return {r["event_id"]: bytes(r["body"]) for r in rows}

    async def endpoint_health(self, endpoint_ids: Sequence[str], window: int) -> dict[str, HealthRow]:
        """One statement for a page of endpoints: each an index range scan of its newest ``window``."""
        if not endpoint_ids:
            return {}
        rows = await self.db.pool.fetch(
            """
            SELECT e.id AS endpoint_id, recent.delivered, recent.failed, newest AS last
              FROM unnest($1::TEXT[]) AS e(id)
             CROSS JOIN LATERAL (
                SELECT count(*) FILTER (WHERE r.status = 'delivered') AS delivered,
                       count(*) FILTER (WHERE r.status = 'failed') AS failed
                  FROM (SELECT d.status FROM webhook_deliveries d WHERE d.endpoint_id = e.id
                         ORDER BY d.seq DESC LIMIT $2) r) recent
              LEFT JOIN LATERAL (
                SELECT d FROM webhook_deliveries d WHERE d.endpoint_id = e.id ORDER BY d.seq DESC LIMIT 1
              ) latest(newest) ON TRUE
            """,
            list(endpoint_ids), window)
        return {
            r["endpoint_id"]: HealthRow(delivered=int(r["delivered"]), failed=int(r["failed"]),
                                        last=DeliveryRow.from_mapping(r["last"]) if r["last"] is not None else None)
            for r in rows
        }


@unavailable_on_connection_errors
class PgDeliveryQueue:
    """The durable schedule of webhook deliveries, shared by any number of notifiers."""

    def __init__(self, db: PgDatabase, sealer: Sealer) -> None:
        self.db = db
        self.sealer = sealer

    async def fan_out(self, events: Sequence[JobEvent]) -> FannedOut:
        """Record the deliveries of ``events`` in one statement (one transaction), each tenant's
        up to its share; returns how many are pending and how many events wait."""
        if not events:
            return FannedOut(0)
        args = _fan_out_args(events)

        async def call() -> asyncpg.Record:
            return await self.db.pool.fetchrow(
                "SELECT * FROM herald_webhook_fan_out($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)", *args)

        row = await _retrying(call)
        return FannedOut(int(row["pending"]), waiting=int(row["waiting"]))

    async def fan_out_leasing(self, events: Sequence[JobEvent], offer: LeaseOffer) -> FannedOut:
        """``fan_out`` and the claim with ``offer``'s caps in one statement (one transaction):
        what is due at once goes out without a claim of its own. The claim is among the targets
        the batch has pending deliveries for (``herald_webhook_claim_among``), as SQLite's is."""
        if not events:
            return FannedOut(0)
        if offer.limit <= 0:
            return await self.fan_out(events)
        busy = {target: n for target, n in offer.in_flight.items() if n}
        tenants = {tenant: n for tenant, n in offer.tenant_in_flight.items() if n > 0}
        args = (*_fan_out_args(events), offer.owner, offer.lease_s, offer.per_target, offer.limit,
                list(busy), list(busy.values()), offer.per_tenant, list(tenants), list(tenants.values()),
                list(offer.held))

        async def call() -> list[asyncpg.Record]:
            return list(await self.db.pool.fetch(
                "SELECT * FROM herald_webhook_fan_out_leasing($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,"
                " $13, $14, $15, $16, $17, $18, $19, $20)", *args))

        rows = await _retrying(call)
        claimed = [await self._claimed(row) for row in rows if row["delivery"] is not None]
        if not rows:
            return FannedOut(0, claimed)
        return FannedOut(int(rows[0]["pending"]), claimed, int(rows[0]["waiting"]))

    async def drain_waiting(self, after: str | None = None) -> Drained:
        """Place the next tenants' waiting events (``herald_webhook_drain_waiting``), in one statement."""

        async def call() -> asyncpg.Record:
            return await self.db.pool.fetchrow("SELECT * FROM herald_webhook_drain_waiting($1, $2, $3, $4)",
                                               PROGRESS_INTERVAL_S, FAN_OUT_SHARE, DRAIN_TENANTS, after)

        row = await _retrying(call)
        return Drained(int(row["events"]), int(row["pending"]), row["last_tenant"])

    async def anything_due(self, held: Collection[str] = ()) -> bool:
        """Cheap read: is a claim worth its transaction?"""
        return bool(await self.db.pool.fetchval(
            "SELECT coalesce(count(*) >= $2 OR bool_or(NOT (due.target = ANY($1::TEXT[]))), FALSE)"
            " FROM (SELECT target FROM webhook_deliveries WHERE status = 'pending'"
            f" AND next_attempt_at <= {NOW} AND (lease_until IS NULL OR lease_until <= {NOW}) LIMIT $2) due",
            list(held), DUE_PROBE_ROWS if held else 1))

    async def next_due_after(self, at: float) -> float | None:
        value = await self.db.pool.fetchval(
            "SELECT min(next_attempt_at) FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at > $1",
            at)
        return float(value) if value is not None else None

    async def claim(
        self, owner: str, *, lease_s: float, per_target: int, limit: int, in_flight: Mapping[str, int],
        per_tenant: int = 0, tenant_in_flight: Mapping[str, int] | None = None, held: Collection[str] = (),
    ) -> list[Claimed]:
        """Lease up to ``limit`` due deliveries nobody holds, fairly among tenants (see ``DeliveryQueue.claim``)."""
        if limit <= 0:
            return []
        busy = {target: n for target, n in in_flight.items() if n}
        tenants = {tenant: n for tenant, n in (tenant_in_flight or {}).items() if n > 0}
        rows = await self.db.pool.fetch(
            "SELECT * FROM herald_webhook_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            owner, lease_s, per_target, limit, list(busy), list(busy.values()),
            per_tenant, list(tenants), list(tenants.values()), list(held))
        return [await self._claimed(row) for row in rows]

    async def defer(self, delivery_ids: Sequence[str], owner: str, targets: Sequence[str], delay_s: float) -> None:
        """Reschedule without an attempt: hand back ``delivery_ids`` (leased by ``owner``) due in
        ``delay_s``, and move every due, unleased pending delivery of ``targets`` to then too."""
        if not delivery_ids and not targets:
            return
        await self.db.pool.execute(
            f"""
            WITH clock AS (SELECT {NOW_SQL} AS ts)
            UPDATE webhook_deliveries d
               SET next_attempt_at = greatest(d.next_attempt_at, clock.ts + $4),
                   lease_owner = NULL, lease_until = NULL
              FROM clock
             WHERE d.status = 'pending'
               AND ((d.id = ANY($1::TEXT[]) AND d.lease_owner = $2)
                    OR (d.target = ANY($3::TEXT[]) AND d.next_attempt_at < clock.ts + $4
                        AND (d.lease_until IS NULL OR d.lease_until <= clock.ts)))
            """,
            list(delivery_ids), owner, list(targets), delay_s)

    async def _claimed(self, row: Mapping[str, Any]) -> Claimed:
        delivery = DeliveryRow.from_mapping(row["delivery"])
        owner = delivery.endpoint_id or callback_owner(delivery.tenant)  # the claim's key owner
        keys = tuple(_key(self.sealer, owner, a, s, p)
                     for a, s, p in zip(row["key_algorithms"] or (), row["key_secrets"] or (),
                                        row["key_public_keys"] or (), strict=True))
        if not keys and delivery.endpoint_id is None:
            # The tenant's first callback delivery: its secret is created on first use.
            await _ensure_current_key(self.db, self.sealer, owner, HMAC)
            keys = tuple(_key(self.sealer, owner, r["algorithm"], r["secret"], r["public_key"])
                         for r in await self.db.pool.fetch(_LIVE_KEYS_SQL, owner))
        trace = (row["job_traceparent"], row["job_tracestate"]) if row["job_traceparent"] else None
        return Claimed(delivery=delivery, url=row["send_url"], body=bytes(row["body"]), keys=keys, trace_context=trace)

    async def finish(self, claimed: Claimed, owner: str, started_at: float, outcome: Outcome, plan: Plan) -> Finished:
        """Log the attempt and apply its plan (delivered, retry later, superseded, failed) in one transaction."""
        d = claimed.delivery
        attempt_id = new_attempt_id()  # one attempt, whichever try of the call below records it

        async def call() -> Finished:
            row = await self.db.pool.fetchrow(
                "SELECT * FROM herald_webhook_finish($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14,"
                " $15)",
                d.id, d.target, d.job_id, owner, started_at, outcome.status_code,
                round(outcome.latency_s * 1000, 3), outcome.error, outcome.response[:RESPONSE_KEEP_BYTES] or None,
                outcome.ok, plan.status, plan.delay_s, plan.disable_endpoint, ENDPOINT_DISABLE_AFTER_S, attempt_id)
            assert row is not None
            return Finished(status=row["o_status"], next_attempt_at=row["o_next_attempt_at"],
                            endpoint_disabled=bool(row["o_endpoint_disabled"]))

        return await _retrying(call)

    async def finish_many(self, attempts: Sequence[Attempted], owner: str) -> list[Finished]:
        """``finish`` for each attempt, in order, in one statement: one transaction, one round trip."""
        if not attempts:
            return []
        ds = [a.claimed.delivery for a in attempts]
        args = (
            [d.id for d in ds], [d.target for d in ds], [d.job_id for d in ds], owner,
            [a.started_at for a in attempts], [a.outcome.status_code for a in attempts],
            [round(a.outcome.latency_s * 1000, 3) for a in attempts], [a.outcome.error for a in attempts],
            [a.outcome.response[:RESPONSE_KEEP_BYTES] or None for a in attempts], [a.outcome.ok for a in attempts],
            [a.plan.status for a in attempts], [a.plan.delay_s for a in attempts],
            [a.plan.disable_endpoint for a in attempts], ENDPOINT_DISABLE_AFTER_S, [a.id for a in attempts],
        )

        async def call() -> list[Finished]:
            rows = await self.db.pool.fetch(
                "SELECT * FROM herald_webhook_finish_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14,"
                " $15) ORDER BY o_ord", *args)
            return [Finished(status=r["o_status"], next_attempt_at=r["o_next_attempt_at"],
                             endpoint_disabled=bool(r["o_endpoint_disabled"])) for r in rows]

        return await _retrying(call)

    async def release(self, delivery_ids: Sequence[str], owner: str) -> None:
        """Hand leases back (shutdown), so another notifier need not wait for them to run out."""
        if delivery_ids:
            await self.db.pool.execute(
                "UPDATE webhook_deliveries SET lease_owner = NULL, lease_until = NULL"
                " WHERE id = ANY($1::TEXT[]) AND lease_owner = $2",
                list(delivery_ids), owner)

    async def renew(self, delivery_ids: Sequence[str], owner: str, lease_s: float) -> None:
        if delivery_ids:  # lease_until is in no index: a HOT update of each row
            await self.db.pool.execute(
                f"UPDATE webhook_deliveries SET lease_until = {NOW} + $3"
                " WHERE id = ANY($1::TEXT[]) AND lease_owner = $2 AND status = 'pending'",
                list(delivery_ids), owner, float(lease_s))

    async def prune(self, finished_before: float, limit: int = 1000) -> int:
        """Forget finished deliveries (with their attempts) older than the retention period; fail
        the pending ones of disabled endpoints that are no longer out."""
        async with self.db.pool.acquire() as conn, conn.transaction():
            # SKIP LOCKED: two notifiers pruning at once split the work instead of queueing.
            pruned = await conn.fetchval(
                """
                WITH gone AS (
                    DELETE FROM webhook_deliveries WHERE id IN (
                        SELECT id FROM webhook_deliveries WHERE status <> 'pending' AND updated_at < $1
                         LIMIT $2 FOR UPDATE SKIP LOCKED)
                    RETURNING id),
                attempts AS (DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM gone))
                SELECT count(*) FROM gone
                """,
                finished_before, limit)
            # Disabled endpoints' deliveries that are no longer out (their notifier died, or
            # handed the lease back unrecorded) fail, as disabling would have.
            await conn.execute(
                f"""
                UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
                       lease_until = NULL, updated_at = {NOW}
                 WHERE id IN (
                    SELECT d.id FROM webhook_endpoints e
                      JOIN webhook_deliveries d ON d.endpoint_id = e.id AND d.status = 'pending'
                     WHERE e.status = 'disabled' AND (d.lease_until IS NULL OR d.lease_until <= {NOW})
                     LIMIT $1 FOR UPDATE OF d SKIP LOCKED)
                   AND status = 'pending' AND (lease_until IS NULL OR lease_until <= {NOW})
                """,
                limit)
            # A later statement, so the deliveries just deleted no longer hold their bodies.
            await conn.execute(
                "DELETE FROM webhook_messages m WHERE m.created_at < $1 AND NOT EXISTS"
                " (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = m.event_id)",
                finished_before)
            return int(pruned)
