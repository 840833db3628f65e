"""The durable delivery queue: webhook deliveries are rows, their schedule is ``next_attempt_at``.

* ``fan_out`` turns committed job events into deliveries, one per matching endpoint and
  one for the job's ``callback_url``, idempotently (one row per target and event), so a
  NATS message delivered twice creates nothing twice. Each tenant's events add at most its
  share to one transaction; the rest wait in ``webhook_fan_out_waiting`` and
  ``drain_waiting`` fans them out, oldest first (``delivery_rules.share_fan_out``).
* ``claim`` leases due deliveries to one notifier process, so any number of them share
  the work and a killed one's deliveries come back when its lease runs out.
* ``finish`` records an attempt and its consequence in one transaction; ``finish_many``
  records many (the notifier's attempts that finished together) in one transaction. An
  attempt is recorded once: one whose ``Attempted.id`` the delivery's log already holds (the
  notifier recording it again after the answer to its record was lost) writes nothing.

Order per job and target: a delivery is claimable only while no older version of the
same job is pending for the same target. Where a new event goes (superseded at once, or
pending and superseding older ones that wait) and what an attempt leaves behind are
decided by ``herald.delivery_rules``; this module reads what those decisions need and
writes what they say. A target is an endpoint id, or ``callback:<url>`` for a job's
callback URL.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

import msgspec

from herald import delivery_rules as rules
from herald.deliveries import (
    CALLBACK_PREFIX,
    DUE_PROBE_ROWS,
    Attempted,
    Claimed,
    DeliveryRow,
    Drained,
    EndpointRow,
    FannedOut,
    Finished,
    LeaseOffer,
    Outcome,
    Plan,
    callback_owner,
    event_id,
    some_target_wants,
)
from herald.delivery_rules import RESPONSE_KEEP_BYTES
from herald.ids import new_id
from herald.sealing import Sealer
from herald.storage.sqlite.db import Database
from herald.storage.sqlite.webhooks import current_callback_key, fail_orphans, fail_pending, live_keys
from herald.timefmt import now
from herald.webhook_signing import SigningKey
from schemas import JobEvent
from schemas.webhooks import WebhookPayload

log = logging.getLogger("herald.notifier")
_payload_encoder = msgspec.json.Encoder()
_event_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(JobEvent)

# The claim reads per tenant and target, never everything pending: the tenants that have
# pending deliveries (a loose index scan: one index probe per tenant, however long each one's
# backlog), then, for each tenant with slots left here, its targets that have pending
# deliveries (one probe per target), then each target's oldest claimable deliveries through
# its own index range, at most the slots the target has left. A tenant at its cap is one
# probe, however many targets and deliveries it has: its candidates could only be dropped
# (``_fair_order``), and reading them was a busy notifier's largest write-lock hold, which
# every other process's writes wait for (bench/RESULTS.md, issue 21). The single query
# before that ranked every pending row with a window function on every claim: its cost grew
# with the backlog (bench/RESULTS.md, issue 14).
_PENDING_TENANTS_SQL = """
WITH RECURSIVE t(tenant) AS (
    SELECT (SELECT MIN(tenant) FROM webhook_deliveries WHERE status = 'pending')
    UNION ALL
    SELECT (SELECT MIN(tenant) FROM webhook_deliveries WHERE status = 'pending' AND tenant > t.tenant)
      FROM t WHERE t.tenant IS NOT NULL
) SELECT tenant FROM t WHERE tenant IS NOT NULL
"""

_PENDING_TARGETS_SQL = """
WITH RECURSIVE t(target) AS (
    SELECT (SELECT MIN(target) FROM webhook_deliveries WHERE status = 'pending' AND tenant = :tenant)
    UNION ALL
    SELECT (SELECT MIN(target) FROM webhook_deliveries
             WHERE status = 'pending' AND tenant = :tenant AND target > t.target)
      FROM t WHERE t.target IS NOT NULL
) SELECT target FROM t WHERE target IS NOT NULL
"""

# INDEXED BY: the per-target range in due order is the point of this query; if the index were
# ever missing it fails loudly instead of quietly scanning.
_TARGET_CANDIDATES_SQL = """
SELECT d.*, e.url AS endpoint_url, m.body AS body, j.traceparent AS job_traceparent,
       j.tracestate AS job_tracestate
FROM webhook_deliveries d INDEXED BY webhook_deliveries_pending_by_tenant
JOIN webhook_messages m ON m.event_id = d.event_id
LEFT JOIN webhook_endpoints e ON e.id = d.endpoint_id
LEFT JOIN jobs j ON j.id = d.job_id
WHERE d.tenant = :tenant AND d.target = :target AND d.status = 'pending' AND d.next_attempt_at <= :now
  AND (d.lease_until IS NULL OR d.lease_until <= :now)
  AND (d.endpoint_id IS NULL OR e.status = 'enabled')
  AND NOT EXISTS (
      SELECT 1 FROM webhook_deliveries o
      WHERE o.target = d.target AND o.job_id = d.job_id AND o.status = 'pending' AND o.version < d.version)
ORDER BY d.next_attempt_at, d.seq LIMIT :room
"""


Target = tuple[str, str | None, str | None]  # (target, endpoint id, callback URL)

# Events waiting for their tenant's share of the fan-out (``delivery_rules.share_fan_out``):
# whether a tenant has any, and which tenants do (a loose index scan, one probe per tenant).
_WAITING_SQL = "SELECT 1 FROM webhook_fan_out_waiting WHERE tenant = ? LIMIT 1"
_WAITING_TENANTS_SQL = """
WITH RECURSIVE t(tenant) AS (
    SELECT (SELECT MIN(tenant) FROM webhook_fan_out_waiting)
    UNION ALL
    SELECT (SELECT MIN(tenant) FROM webhook_fan_out_waiting WHERE tenant > t.tenant) FROM t WHERE t.tenant IS NOT NULL
) SELECT tenant FROM t WHERE tenant IS NOT NULL
"""


def _targets(event: JobEvent, endpoints: Sequence[EndpointRow], callback_url: str | None) -> list[Target]:
    """Every receiver of ``event``: the matching enabled endpoints and the job's callback URL
    (``_callback_url``)."""
    targets: list[Target] = [
        (e.id, e.id, None) for e in endpoints if e.wants(event.type, event.kind)
    ]
    if callback_url:
        targets.append((CALLBACK_PREFIX + callback_url, None, callback_url))
    return targets


def _callback_url(db: Database, event: JobEvent) -> str | None:
    """Where the job's ``callback_url`` wants ``event``: every type but progress (SPEC §7). Read
    from the job's row (same store) rather than carried in every event, so it is never copied
    into the stream's history; a job's callback URL never changes."""
    if event.type == "job.progress":
        return None
    rows = db.read("SELECT callback_url FROM jobs WHERE id = ?", (event.job_id,))
    return (rows[0]["callback_url"] or None) if rows else None


def _callback_url_in(conn: sqlite3.Connection, event: JobEvent) -> str | None:
    """``_callback_url``, read in a writing transaction."""
    if event.type == "job.progress":
        return None
    row = conn.execute("SELECT callback_url FROM jobs WHERE id = ?", (event.job_id,)).fetchone()
    return (row["callback_url"] or None) if row is not None else None


# What ``delivery_rules.place`` needs: the job's deliveries at the target, in one probe of
# (target, job_id). ``event_id`` is made of job id and version, so a redelivered event is
# among them.
_SIBLINGS_SQL = (
    "SELECT event_id, version, type, status, attempts, scheduled_at, lease_until FROM webhook_deliveries"
    " WHERE target = ? AND job_id = ?"
)


def _add_delivery(
    conn: sqlite3.Connection, event: JobEvent, target: str, endpoint_id: str | None, url: str | None, ts: float
) -> bool:
    eid = event_id(event)
    siblings = [rules.Sibling(*row) for row in conn.execute(_SIBLINGS_SQL, (target, event.job_id))]
    placement = rules.place(siblings, event_id=eid, version=event.version, type=event.type, at=ts)
    if placement is None:
        return False  # a redelivered NATS message: already fanned out
    conn.executemany(
        "UPDATE webhook_deliveries SET status = 'superseded', next_attempt_at = NULL, updated_at = ?"
        " WHERE target = ? AND job_id = ? AND version = ?",
        [(ts, target, event.job_id, version) for version in placement.supersede],
    )
    conn.execute(
        "INSERT INTO webhook_deliveries (id, tenant, target, endpoint_id, url, event_id, job_id, version, type,"
        " status, scheduled_at, next_attempt_at, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (new_id(), event.tenant, target, endpoint_id, url, eid, event.job_id, event.version, event.type,
         placement.status, placement.due, placement.next_attempt_at, ts, ts),
    )
    return placement.status == "pending"


Receivers = tuple[JobEvent, list[Target]]  # an event and every target that wants it


def _receivers(conn: sqlite3.Connection, targeted: Sequence[tuple[JobEvent, str | None]]) -> list[Receivers]:
    """Each event with its receivers now (``_targets``), given its job's callback URL; the
    endpoints are read in the writing transaction (one enabled at the loop's read may be gone)."""
    endpoints: dict[str, list[EndpointRow]] = {}
    receivers: list[Receivers] = []
    for event, callback_url in targeted:
        if event.tenant not in endpoints:
            rows = conn.execute("SELECT * FROM webhook_endpoints WHERE tenant = ? AND status = 'enabled'",
                                (event.tenant,)).fetchall()
            endpoints[event.tenant] = [EndpointRow.from_mapping(r) for r in rows]
        receivers.append((event, _targets(event, endpoints[event.tenant], callback_url)))
    return receivers


def _share(conn: sqlite3.Connection, receivers: Sequence[Receivers], ts: float) -> tuple[list[Receivers], int]:
    """The events fanned out now (``delivery_rules.share_fan_out``); the rest are put to wait,
    each behind its tenant's earlier ones. Returns those fanned out now and how many wait."""
    tenants = {event.tenant for event, _ in receivers}
    waiting = {t for t in tenants if conn.execute(_WAITING_SQL, (t,)).fetchone() is not None}
    goes = rules.share_fan_out([(event.tenant, len(targets)) for event, targets in receivers], waiting)
    later = [event for (event, _), go in zip(receivers, goes, strict=True) if not go]
    conn.executemany("INSERT INTO webhook_fan_out_waiting (tenant, event, created_at) VALUES (?,?,?)",
                     [(event.tenant, _event_encoder.encode(event), ts) for event in later])
    return [r for r, go in zip(receivers, goes, strict=True) if go], len(later)


def _record(conn: sqlite3.Connection, receivers: Sequence[Receivers], ts: float) -> tuple[int, dict[str, set[str]]]:
    """The fan-out's writes for events and their receivers: how many deliveries are pending,
    and by tenant the targets that got one."""
    pending = 0
    touched: dict[str, set[str]] = {}
    for event, targets in receivers:
        if not targets:
            continue
        body = _payload_encoder.encode(WebhookPayload(type=event.type, timestamp=event.at, data=event.data))
        conn.execute("INSERT OR IGNORE INTO webhook_messages (event_id, body, created_at) VALUES (?,?,?)",
                     (event_id(event), body, ts))
        for target, endpoint_id, url in targets:
            if _add_delivery(conn, event, target, endpoint_id, url, ts):
                pending += 1
                touched.setdefault(event.tenant, set()).add(target)
    return pending, touched


def _drain(conn: sqlite3.Connection, ts: float, after: str | None) -> Drained:
    """The oldest waiting events of the next ``DRAIN_TENANTS`` tenants with some waiting after
    ``after`` (wrapping round), each tenant's up to its share, fanned out and no longer waiting."""
    tenants = [row[0] for row in conn.execute(_WAITING_TENANTS_SQL)]
    turn = [t for t in tenants if after is None or t > after] + [t for t in tenants if after is not None and t <= after]
    drained: list[Receivers] = []
    seqs: list[tuple[int]] = []
    taken = turn[:rules.DRAIN_TENANTS]
    for tenant in taken:
        rows = conn.execute("SELECT seq, event FROM webhook_fan_out_waiting WHERE tenant = ? ORDER BY seq LIMIT ?",
                            (tenant, rules.FAN_OUT_SHARE)).fetchall()
        events: list[tuple[int, JobEvent]] = []
        for row in rows:
            try:
                events.append((row["seq"], _event_decoder.decode(row["event"])))
            except msgspec.DecodeError:  # never written so by this Herald: dropped, or it would stop every drain
                log.error("undecodable waiting job event dropped", extra={"tenant": tenant, "seq": row["seq"]})
                seqs.append((row["seq"],))
        receivers = _receivers(conn, [(event, _callback_url_in(conn, event)) for _, event in events])
        goes = rules.share_fan_out([(tenant, len(targets)) for _, targets in receivers])
        take = goes.index(False) if False in goes else len(goes)  # one tenant's: a run of True, then False
        drained += receivers[:take]
        seqs += [(seq,) for seq, _ in events[:take]]
    pending, _ = _record(conn, drained, ts)
    conn.executemany("DELETE FROM webhook_fan_out_waiting WHERE seq = ?", seqs)
    return Drained(len(seqs), pending, taken[-1] if taken else None)


def _lease(conn: sqlite3.Connection, ts: float, rows: Sequence[sqlite3.Row], owner: str, lease_s: float,
           sealer: Sealer) -> list[Claimed]:
    """Lease the candidate ``rows`` (``_TARGET_CANDIDATES_SQL``) to ``owner``, each with what sending needs."""
    keys_by_owner: dict[str, tuple[SigningKey, ...]] = {}
    claimed: list[Claimed] = []
    conn.executemany("UPDATE webhook_deliveries SET lease_owner = ?, lease_until = ? WHERE id = ?",
                     [(owner, ts + lease_s, row["id"]) for row in rows])
    for row in rows:
        key_owner = row["endpoint_id"] or callback_owner(row["tenant"])
        if key_owner not in keys_by_owner:
            if row["endpoint_id"] is None:
                current_callback_key(conn, row["tenant"], ts, sealer)  # created on first use
            keys_by_owner[key_owner] = tuple(live_keys(conn, key_owner, ts, sealer))
        delivery = replace(DeliveryRow.from_mapping(row), lease_owner=owner, lease_until=ts + lease_s)  # as leased
        url = row["endpoint_url"] if row["endpoint_id"] is not None else row["url"]
        trace = (row["job_traceparent"], row["job_tracestate"]) if row["job_traceparent"] else None
        claimed.append(Claimed(delivery=delivery, url=url, body=bytes(row["body"]), keys=keys_by_owner[key_owner],
                               trace_context=trace))
    return claimed


class SqliteDeliveryQueue:
    def __init__(self, db: Database, sealer: Sealer) -> None:
        self.db = db
        self.sealer = sealer

    async def fan_out(self, events: Sequence[JobEvent]) -> FannedOut:
        """Record the deliveries of ``events`` in one transaction, each tenant's up to its share."""
        targeted = self._targeted(events)
        if not targeted:
            return FannedOut(0)

        def tx(conn: sqlite3.Connection) -> FannedOut:
            ts = now()
            receivers, waiting = _share(conn, _receivers(conn, targeted), ts)
            return FannedOut(_record(conn, receivers, ts)[0], waiting=waiting)

        return await self.db.write(tx)

    async def fan_out_leasing(self, events: Sequence[JobEvent], offer: LeaseOffer) -> FannedOut:
        """``fan_out``, then ``claim`` among the targets it recorded for, in the same transaction."""
        targeted = self._targeted(events)
        if not targeted:
            return FannedOut(0)

        def tx(conn: sqlite3.Connection) -> FannedOut:
            ts = now()
            receivers, waiting = _share(conn, _receivers(conn, targeted), ts)
            pending, touched = _record(conn, receivers, ts)
            if not touched or offer.limit <= 0:
                return FannedOut(pending, waiting=waiting)
            busy = offer.tenant_in_flight
            rows = _fair_order(_candidates(conn, ts, offer.per_target, offer.in_flight, offer.per_tenant, busy,
                                           offer.held, only=touched), busy, offer.per_tenant)[:offer.limit]
            return FannedOut(pending, _lease(conn, ts, rows, offer.owner, offer.lease_s, self.sealer), waiting)

        return await self.db.write(tx)

    async def drain_waiting(self, after: str | None = None) -> Drained:
        """Fan out the next tenants' waiting events (``_drain``); an idle store costs one read, no write."""
        if not self.db.read("SELECT 1 FROM webhook_fan_out_waiting LIMIT 1"):
            return Drained(0, 0)
        return await self.db.write(lambda conn: _drain(conn, now(), after))

    def _targeted(self, events: Sequence[JobEvent]) -> list[tuple[JobEvent, str | None]]:
        """The events some target may want, each with its job's callback URL, judged by reads on
        the loop: a batch of events nobody wants (most of a busy notifier's: queued and running,
        when endpoints ask for the outcome only) takes no write transaction. The transaction
        reads the endpoints again (one enabled now may be gone by then)."""
        endpoints: dict[str, list[EndpointRow]] = {}
        targeted: list[tuple[JobEvent, str | None]] = []
        for event in events:
            if event.tenant not in endpoints:
                rows = self.db.read("SELECT * FROM webhook_endpoints WHERE tenant = ? AND status = 'enabled'",
                                    (event.tenant,))
                endpoints[event.tenant] = [EndpointRow.from_mapping(r) for r in rows]
            callback_url = _callback_url(self.db, event)
            if some_target_wants(event.type, event.kind, endpoints[event.tenant], callback_url):
                targeted.append((event, callback_url))
        return targeted

    async def anything_due(self, held: Collection[str] = ()) -> bool:
        """Cheap read on the loop: is a claim transaction worth taking the write lock for?"""
        ts = now()
        rows = self.db.read(
            "SELECT target FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= ?"
            " AND (lease_until IS NULL OR lease_until <= ?) LIMIT ?",
            (ts, ts, DUE_PROBE_ROWS if held else 1),
        )
        held_targets = set(held)
        return len(rows) >= DUE_PROBE_ROWS or any(row[0] not in held_targets for row in rows)

    async def next_due_after(self, at: float) -> float | None:
        rows = self.db.read(
            "SELECT MIN(next_attempt_at) AS t FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at > ?",
            (at,),
        )
        return rows[0]["t"] if rows else None

    async def claim(
        self, owner: str, *, lease_s: float, per_target: int, limit: int, in_flight: Mapping[str, int],
        per_tenant: int = 0, tenant_in_flight: Mapping[str, int] | None = None, held: Collection[str] = (),
    ) -> list[Claimed]:
        """Lease up to ``limit`` due deliveries, fairly among tenants (see ``DeliveryQueue.claim``)."""
        tenants_busy = tenant_in_flight or {}

        def tx(conn: sqlite3.Connection) -> list[Claimed]:
            ts = now()
            rows = _fair_order(_candidates(conn, ts, per_target, in_flight, per_tenant, tenants_busy, held),
                               tenants_busy, per_tenant)[:limit]
            return _lease(conn, ts, rows, owner, lease_s, self.sealer)

        return await self.db.write(tx)

    async def defer(self, delivery_ids: Sequence[str], owner: str, targets: Sequence[str], delay_s: float) -> None:
        """Reschedule without an attempt: hand back ``delivery_ids`` (leased by ``owner``) due in
        ``delay_s``, and move every due, unleased pending delivery of ``targets`` to then too."""
        if not delivery_ids and not targets:
            return

        def tx(conn: sqlite3.Connection) -> None:
            ts = now()
            until = ts + delay_s
            conn.executemany(
                "UPDATE webhook_deliveries SET next_attempt_at = MAX(next_attempt_at, ?), lease_owner = NULL,"
                " lease_until = NULL WHERE id = ? AND lease_owner = ? AND status = 'pending'",
                [(until, i, owner) for i in delivery_ids])
            conn.executemany(
                "UPDATE webhook_deliveries SET next_attempt_at = ? WHERE target = ? AND status = 'pending'"
                " AND next_attempt_at < ? AND (lease_until IS NULL OR lease_until <= ?)",
                [(until, t, until, ts) for t in targets])

        await self.db.write(tx)

    async def finish(self, claimed: Claimed, owner: str, started_at: float, outcome: Outcome, plan: Plan) -> Finished:
        """Log the attempt and apply its plan: delivered, retry later, superseded, or failed."""
        attempt = Attempted(claimed=claimed, started_at=started_at, outcome=outcome, plan=plan)
        return await self.db.write(lambda conn: _finish(conn, attempt, owner, now()))

    async def finish_many(self, attempts: Sequence[Attempted], owner: str) -> list[Finished]:
        """``finish`` for each attempt, in order, in one transaction (one lock, one commit for all)."""
        if not attempts:
            return []

        def tx(conn: sqlite3.Connection) -> list[Finished]:
            return _finish_many(conn, attempts, owner, now())

        return await self.db.write(tx)

    async def release(self, delivery_ids: Sequence[str], owner: str) -> None:
        """Hand leases back (shutdown), so another notifier need not wait for them to run out."""

        def tx(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "UPDATE webhook_deliveries SET lease_owner = NULL, lease_until = NULL WHERE id = ? AND lease_owner = ?",
                [(i, owner) for i in delivery_ids],
            )

        await self.db.write(tx)

    async def renew(self, delivery_ids: Sequence[str], owner: str, lease_s: float) -> None:
        if not delivery_ids:
            return

        def tx(conn: sqlite3.Connection) -> None:
            until = now() + lease_s
            conn.executemany(
                "UPDATE webhook_deliveries SET lease_until = ? WHERE id = ? AND lease_owner = ? AND status = 'pending'",
                [(until, i, owner) for i in delivery_ids],
            )

        await self.db.write(tx)

    async def prune(self, finished_before: float, limit: int = 1000) -> int:
        """Forget finished deliveries (with their attempts) older than the retention period; fail
        the pending ones of disabled endpoints that are no longer out (``fail_orphans``)."""

        def tx(conn: sqlite3.Connection) -> int:
            fail_orphans(conn, now(), limit)
            ids = [r["id"] for r in conn.execute(
                "SELECT id FROM webhook_deliveries WHERE status != 'pending' AND updated_at < ? LIMIT ?",
                (finished_before, limit),
            ).fetchall()]
            conn.executemany("DELETE FROM webhook_attempts WHERE delivery_id = ?", [(i,) for i in ids])
            conn.executemany("DELETE FROM webhook_deliveries WHERE id = ?", [(i,) for i in ids])
            conn.execute(
                "DELETE FROM webhook_messages WHERE created_at < ? AND NOT EXISTS"
                " (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = webhook_messages.event_id)",
                (finished_before,),
            )
            return len(ids)

        return await self.db.write(tx)


def _candidates(
    conn: sqlite3.Connection, ts: float, per_target: int, in_flight: Mapping[str, int], per_tenant: int,
    busy: Mapping[str, int], held: Collection[str], only: Mapping[str, Collection[str]] | None = None,
) -> dict[str, list[tuple[int, sqlite3.Row]]]:
    """Each target's oldest claimable deliveries, at most the slots it has left here, by tenant,
    each with its rank in its target. Not read at all: a tenant at its cap (none of its
    deliveries could be taken), a target with no slot left or held back by the notifier (so
    they cannot crowd out the rest either). ``only``: these tenants' targets, not every one
    with pending deliveries (a fan-out's own)."""
    held = set(held)
    by_target: dict[str, list[sqlite3.Row]] = {}
    tenants = sorted(only) if only is not None else [t for (t,) in conn.execute(_PENDING_TENANTS_SQL).fetchall()]
    for tenant in tenants:
        if per_tenant > 0 and busy.get(tenant, 0) >= per_tenant:
            continue
        targets = (sorted(only[tenant]) if only is not None
                   else [t for (t,) in conn.execute(_PENDING_TARGETS_SQL, {"tenant": tenant}).fetchall()])
        for target in targets:
            room = per_target - in_flight.get(target, 0)
            if room > 0 and target not in held:
                by_target.setdefault(target, []).extend(conn.execute(
                    _TARGET_CANDIDATES_SQL, {"tenant": tenant, "target": target, "now": ts, "room": room}))
    by_tenant: dict[str, list[tuple[int, sqlite3.Row]]] = {}
    for target, rows in by_target.items():
        if len(rows) > 1:  # a target several tenants send to (a shared callback URL): oldest first over them
            rows.sort(key=lambda r: (r["next_attempt_at"], r["seq"]))
        for rank, row in enumerate(rows[:per_target - in_flight.get(target, 0)]):
            by_tenant.setdefault(row["tenant"], []).append((rank, row))
    return by_tenant


def _fair_order(
    by_tenant: Mapping[str, list[tuple[int, sqlite3.Row]]], busy: Mapping[str, int], per_tenant: int
) -> list[sqlite3.Row]:
    """The candidates in the order free slots should go (SPEC §13), as the PostgreSQL claim does:
    within a tenant round robin over its targets (a candidate's rank in its target first), cut
    at the slots the tenant has left; across tenants the fewest in flight first (slot k of a
    tenant with n in flight sorts at n + k), then oldest first."""
    keyed: list[tuple[int, float, int, sqlite3.Row]] = []
    for tenant, candidates in by_tenant.items():
        candidates.sort(key=lambda c: (c[0], c[1]["next_attempt_at"], c[1]["seq"]))
        n = busy.get(tenant, 0)
        for k, (_rank, row) in enumerate(candidates, start=1):
            if per_tenant > 0 and n + k > per_tenant:
                break
            keyed.append((n + k, row["next_attempt_at"], row["seq"], row))
    keyed.sort(key=lambda c: c[:3])
    return [c[3] for c in keyed]


_DROPPED = Finished(status="dropped", next_attempt_at=None, endpoint_disabled=False)  # its endpoint was deleted
_DELIVERED = Finished(status="delivered", next_attempt_at=None, endpoint_disabled=False)
_CHUNK = 500  # ids per IN (...) list, well within SQLite's limit on parameters


def _finish_many(conn: sqlite3.Connection, attempts: Sequence[Attempted], owner: str, ts: float) -> list[Finished]:
    """``_finish`` for each attempt, the common case set-based.

    A 2xx answer (delivered), each delivery once in the batch, is what a busy notifier
    records nearly always: for those, one read of which deliveries still exist, one of
    their attempt counts, and one ``executemany`` each for the attempts, the deliveries and
    the endpoints' failing streaks, instead of five statements per attempt. The rest
    (failures, retries, a delivery twice in a batch) go through ``_finish`` one by one,
    in order, after them.
    """
    results: list[Finished | None] = [None] * len(attempts)
    times = Counter(a.claimed.delivery.id for a in attempts)
    fast = [i for i, a in enumerate(attempts)
            if rules.settles_alone(a.plan, ok=a.outcome.ok) and times[a.claimed.delivery.id] == 1]
    if fast:
        ids = [attempts[i].claimed.delivery.id for i in fast]
        present: set[str] = set()
        last_n: dict[str, int] = {}
        logged_ids: set[tuple[str, str]] = set()
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start:start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            present.update(r[0] for r in conn.execute(f"SELECT id FROM webhook_deliveries WHERE id IN ({marks})", chunk))
            for delivery_id, n, attempt_id in conn.execute(
                    f"SELECT delivery_id, n, attempt_id FROM webhook_attempts WHERE delivery_id IN ({marks})", chunk):
                last_n[delivery_id] = max(n, last_n.get(delivery_id, 0))
                logged_ids.add((delivery_id, attempt_id))
        logged, settled, healthy = [], [], set()
        for i in fast:
            attempt = attempts[i]
            d, outcome = attempt.claimed.delivery, attempt.outcome
            if d.id not in present:
                results[i] = _DROPPED
                continue
            if (d.id, attempt.id) in logged_ids:
                continue  # recorded before (the answer to that record was lost): _finish answers it
            n = last_n.get(d.id, 0) + 1
            logged.append((d.id, n, attempt.started_at, outcome.status_code, round(outcome.latency_s * 1000, 3),
                           outcome.error, outcome.response[:RESPONSE_KEEP_BYTES] or None, attempt.id))
            settled.append((n, ts, d.id, owner))
            if d.endpoint_id is not None:
                healthy.add(d.endpoint_id)
            results[i] = _DELIVERED
        conn.executemany(
            "INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response, attempt_id)"
            " VALUES (?,?,?,?,?,?,?,?)", logged)
        conn.executemany(
            "UPDATE webhook_deliveries SET status = 'delivered', attempts = ?, next_attempt_at = NULL,"
            " lease_owner = NULL, lease_until = NULL, retry_asked_at = NULL, updated_at = ?"
            " WHERE id = ? AND lease_owner = ?", settled)
        conn.executemany("UPDATE webhook_endpoints SET failing_since = NULL WHERE id = ? AND failing_since IS NOT NULL",
                         [(e,) for e in sorted(healthy)])
    return [result if result is not None else _finish(conn, attempt, owner, ts)
            for attempt, result in zip(attempts, results, strict=True)]


def _finish(conn: sqlite3.Connection, attempt: Attempted, owner: str, ts: float) -> Finished:
    """Log one attempt and settle it (``delivery_rules.settle``), inside the caller's transaction."""
    d, outcome, plan = attempt.claimed.delivery, attempt.outcome, attempt.plan
    current = conn.execute("SELECT status, next_attempt_at, retry_asked_at FROM webhook_deliveries WHERE id = ?",
                           (d.id,)).fetchone()
    if current is None:
        return _DROPPED
    n, seen = conn.execute("SELECT COALESCE(MAX(n), 0) + 1, COALESCE(MAX(attempt_id = ?), 0) FROM webhook_attempts"
                           " WHERE delivery_id = ?", (attempt.id, d.id)).fetchone()
    row = conn.execute("SELECT status, failing_since FROM webhook_endpoints WHERE id = ?",
                       (d.endpoint_id,)).fetchone() if d.endpoint_id is not None else None
    endpoint = rules.EndpointState(row["status"], row["failing_since"]) if row is not None else None
    if seen:  # recorded before: the answer to that record was lost, not the record
        again = rules.settled_before(current["status"], current["next_attempt_at"], ok=outcome.ok, endpoint=endpoint)
        return Finished(status=again.status, next_attempt_at=again.next_attempt_at,
                        endpoint_disabled=again.endpoint_disabled)
    conn.execute(
        "INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response, attempt_id)"
        " VALUES (?,?,?,?,?,?,?,?)",
        (d.id, n, attempt.started_at, outcome.status_code, round(outcome.latency_s * 1000, 3), outcome.error,
         outcome.response[:RESPONSE_KEEP_BYTES] or None, attempt.id),
    )
    newer = conn.execute(
        "SELECT 1 FROM webhook_deliveries WHERE target = ? AND job_id = ? AND version > ? LIMIT 1",
        (d.target, d.job_id, d.version),
    ).fetchone() is not None
    settled = rules.settle(plan, ok=outcome.ok, newer=newer, endpoint=endpoint, at=ts,
                           retry_asked=current["retry_asked_at"] is not None)
    if endpoint is not None and d.endpoint_id is not None:
        if settled.failing_since != endpoint.failing_since:
            conn.execute("UPDATE webhook_endpoints SET failing_since = ? WHERE id = ?",
                         (settled.failing_since, d.endpoint_id))
        if settled.disable:
            conn.execute("UPDATE webhook_endpoints SET status = 'disabled', updated_at = ? WHERE id = ?",
                         (ts, d.endpoint_id))
            fail_pending(conn, d.endpoint_id, ts, sparing=d.id)  # this one is settled just below
    conn.execute(
        "UPDATE webhook_deliveries SET status = ?, attempts = ?, next_attempt_at = ?, lease_owner = NULL,"
        " lease_until = NULL, retry_asked_at = NULL, updated_at = ? WHERE id = ? AND lease_owner = ?",
        (settled.status, n, settled.next_attempt_at, ts, d.id, owner),
    )
    return Finished(status=settled.status, next_attempt_at=settled.next_attempt_at,
                    endpoint_disabled=settled.endpoint_disabled)
