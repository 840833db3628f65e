"""The SQLite job store: jobs, their history (events), the outbox and idempotency keys.

The embedded default (``herald.storage.ports.JobStore``): every process of one machine
opens the same file. SQLite serialises writers with one database-wide lock
(``BEGIN IMMEDIATE``), so each transaction below is compare-and-set by construction: the
row it reads cannot change before it writes. The clock is this machine's.

That lock is every process's one queue, so what need not be under it is done before it:
events are encoded without their ``seq`` (``herald.storage.unnumbered``), and a transition
on a row this process remembers (``herald.storage.recent_rows``) is judged on it first; its
transaction compares-and-sets on that row and reads the job only on a miss.

``transition()`` is the only code that changes a job after it was accepted. In one
transaction it checks the expected state and attempt, updates the row, appends the
committed status snapshot to the job's history with a new tenant-wide sequence number,
and adds the outbox rows that announce it. Everything any client is ever told is derived
from those rows.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from herald.constants import event_subject, job_subject
from herald.deliveries import some_target_wants
from herald.jobs import (
    Accepted,
    IdempotencyClaim,
    IdempotencyMismatch,
    JobRow,
    NewJob,
    RateLimited,
    StoreUnwritable,
    Transition,
    TransitionRejected,
)
from herald import workmessage
from herald.sealing import Sealer, secret_aad
from herald.storage.committing import CommitListeners
from herald.storage.live_scan import OLDEST_OF_TENANT_KIND, QUEUED_TENANT_KINDS
from herald.storage.ports import OutboxRow, StartBudget, StoreStats
from herald.storage.recent_rows import RecentRows
from herald.storage.sqlite import resealing
from herald.storage.sqlite.db import Database, unwritable_reason
from herald.storage.unnumbered import numbered_payload, unnumbered_event
from herald.timefmt import now, rfc3339
from herald.transitions import TENANT_AT_CAP, Change, changed_row, event_type, refusal
from schemas import JobEvent

# The tables: sql/0001_jobs.sql and 0005 beside this package's schema.py. State names in the SQL below
# are the values of ``schemas.jobs.JobState`` (the one list), written out because a query must
# repeat a partial index's predicate literally for the planner to use the index.

_SIGNING_KEY_NAME = "url-signing"

# Each kind's oldest queued job: a loose scan of jobs_live_by_tenant (herald/storage/live_scan.py).
_QUEUED_SINCE_BY_KIND = (
    QUEUED_TENANT_KINDS
    + f"\nSELECT q.kind, MIN({OLDEST_OF_TENANT_KIND}) AS since FROM q WHERE q.kind IS NOT NULL GROUP BY q.kind\n"
)


def _fetch(conn: sqlite3.Connection, job_id: str) -> JobRow | None:
    row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return JobRow.from_mapping(row) if row else None


def _spend_start_token(conn: sqlite3.Connection, tenant: str, budget: StartBudget, ts: float) -> None:
    """Take one token from the tenant's bucket (inside the accept transaction) or raise RateLimited."""
    row = conn.execute("SELECT tokens, at FROM rate_buckets WHERE tenant = ?", (tenant,)).fetchone()
    tokens = budget.burst if row is None else min(budget.burst, row["tokens"] + max(0.0, ts - row["at"]) * budget.rate)
    if tokens < 1:
        raise RateLimited(tenant, (1 - tokens) / budget.rate)
    conn.execute(
        "INSERT INTO rate_buckets (tenant, tokens, at) VALUES (?,?,?)"
        " ON CONFLICT (tenant) DO UPDATE SET tokens = excluded.tokens, at = excluded.at",
        (tenant, tokens - 1, ts),
    )


def _append_event(conn: sqlite3.Connection, job: JobRow, event_type: str, origin: str) -> JobEvent:
    """History row + outbox row for the job's current version (inside the caller's tx)."""
    event, tail = unnumbered_event(job, event_type)
    return _append_unnumbered(conn, job, event, tail, origin)


def _append_unnumbered(conn: sqlite3.Connection, job: JobRow, event: JobEvent, tail: bytes, origin: str) -> JobEvent:
    """``_append_event`` with the event encoded before the transaction (``unnumbered_event``):
    only its number is taken here."""
    (seq,) = conn.execute(
        "INSERT INTO tenant_seq (tenant, last) VALUES (?, 1) "
        "ON CONFLICT (tenant) DO UPDATE SET last = last + 1 RETURNING last",
        (job.tenant,),
    ).fetchone()
    conn.execute(
        "INSERT INTO events (tenant, seq, job_id, kind, version, type, at, data) VALUES (?,?,?,?,?,?,?,?)",
        (job.tenant, seq, job.id, job.kind, job.version, event.type, job.updated_at, bytes(event.data)),
    )
    subject = event_subject(job.tenant, job.id, _some_target_wants(conn, job, event.type))
    _enqueue(conn, subject, f"ev.{job.id}.{job.version}", numbered_payload(seq, tail), job, origin)
    return msgspec.structs.replace(event, seq=seq)


# ``EndpointRow.wants`` in SQL: one probe in C per event, whatever the tenant's number of
# endpoints (up to ``max_endpoints``, each a row to decode in Python).
_ENDPOINT_WANTS_SQL = """
SELECT EXISTS (SELECT 1 FROM webhook_endpoints e
                WHERE e.tenant = ? AND e.status = 'enabled'
                  AND EXISTS (SELECT 1 FROM json_each(e.event_types) WHERE value = ?)
                  AND (e.kinds IS NULL OR EXISTS (SELECT 1 FROM json_each(e.kinds) WHERE value = ?)))
"""


def _some_target_wants(conn: sqlite3.Connection, job: JobRow, event_type: str) -> bool:
    """``herald.deliveries.some_target_wants``, judged in the transaction that commits the
    event, so an endpoint enabled before it commits is counted (one writer at a time)."""
    if some_target_wants(event_type, job.kind, (), job.callback_url):
        return True
    return bool(conn.execute(_ENDPOINT_WANTS_SQL, (job.tenant, event_type, job.kind)).fetchone()[0])


def _enqueue(conn: sqlite3.Connection, subject: str, msg_id: str, payload: bytes, job: JobRow, origin: str) -> None:
    # The job's trace context rides along: the relay sends it as the message's headers.
    # ``origin`` names the committing process, whose relay publishes the row (see outbox_batch).
    conn.execute(
        "INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate, origin)"
        " VALUES (?,?,?,?,?,?,?)",
        (subject, msg_id, payload, now(), job.traceparent, job.tracestate, origin),
    )


def _enqueue_work(conn: sqlite3.Connection, job: JobRow, origin: str, message: bytes | None = None) -> None:
    """The job's work message for its current attempt into the outbox (``message``: encoded
    already, outside the transaction)."""
    # The first message's id is the job id (SPEC §3); a re-queue needs a fresh id, or
    # JetStream's duplicate window would swallow it.
    msg_id = job.id if job.attempt == 0 else f"{job.id}.a{job.attempt}"
    _enqueue(conn, job_subject(job.kind, job.tenant), msg_id, message or _work_message(job), job, origin)


def _work_message(job: JobRow) -> bytes:
    # Without the job's row: a worker's read here is a lookup in its own file, outside the
    # write lock, and the claim is judged on what it read (``herald.workmessage``).
    return workmessage.encode(job, carry_row=False)


@dataclass(frozen=True, slots=True)
class _Judged:
    """A change judged on a remembered row, ready to compare-and-set on it."""

    before: JobRow
    after: JobRow
    values: dict[str, Any]
    event: JobEvent  # at seq 0
    tail: bytes  # its payload without the seq head


def _judge_remembered(before: JobRow | None, change: Change, retention_s: float) -> _Judged | None:
    """The change as it would apply to ``before``, if the rules allow it there and it changes
    something visible; else None (judged under the lock on the row as it is)."""
    if before is None or refusal(before, change) is not None:
        return None
    after, values = changed_row(before, change, at=max(now(), before.updated_at), retention_s=retention_s)
    kind_of_change = event_type(before, after)
    if kind_of_change is None:
        return None
    event, tail = unnumbered_event(after, kind_of_change)
    return _Judged(before=before, after=after, values=values, event=event, tail=tail)


def _apply_judged(conn: sqlite3.Connection, judged: _Judged, change: Change, origin: str) -> Transition | None:
    """Inside the transaction: the judged change if the job is still the remembered row (and,
    for a capped claim, its tenant below the cap); None to judge again on the row as it is."""
    before, after = judged.before, judged.after
    if change.claim and change.max_running > 0 and _at_cap(conn, before.tenant, change.max_running):
        return None  # said only of the row as it is now
    if not _update_job(conn, after, judged.values, expected=before):
        return None  # moved since (another transition, a heartbeat)
    event = _append_unnumbered(conn, after, judged.event, judged.tail, origin)
    if change.requeue:
        _enqueue_work(conn, after, origin)
    return Transition(before=before, after=after, event=event)


def _at_cap(conn: sqlite3.Connection, tenant: str, max_running: int) -> bool:
    # BEGIN IMMEDIATE holds the one write lock: no other claim counts meanwhile.
    (running,) = conn.execute(
        "SELECT COUNT(*) FROM jobs WHERE tenant = ? AND state = 'running'", (tenant,)
    ).fetchone()
    return bool(running >= max_running)


def _update_job(conn: sqlite3.Connection, after: JobRow, values: dict[str, Any], *, expected: JobRow | None = None) -> bool:
    """Write the changed columns and the new version; with ``expected``, only if the row is
    still at its version and ``updated_at`` (a heartbeat moves the latter, not the former)."""
    assignments = ", ".join(f"{column} = ?" for column in values)
    if expected is None:
        conn.execute(f"UPDATE jobs SET {assignments}, version = ? WHERE id = ?",
                     (*values.values(), after.version, after.id))
        return True
    cursor = conn.execute(
        f"UPDATE jobs SET {assignments}, version = ? WHERE id = ? AND version = ? AND updated_at = ?",
        (*values.values(), after.version, after.id, expected.version, expected.updated_at),
    )
    return cursor.rowcount == 1


class SqliteJobStore(CommitListeners):
    """The job store on one SQLite file. One per process; processes of one machine share the file."""

    keeps_results = True  # a small JSON result rides in the success's transaction (jobs.result_body)

    def __init__(self, db: Database, *, retention_s: float, sealer: Sealer) -> None:
        self._db = db
        self.retention_s = retention_s
        self._sealer = sealer
        self._rows = RecentRows()
        # Outbox rows published, whose delete waits to ride with this process's next commit:
        # never handed out again, nor counted as pending, meanwhile.
        self._deleting: set[int] = set()
        super().__init__()

    async def open(self) -> None:
        await self._db.open()
        # A store an older Herald wrote keeps its secrets in plaintext: sealed now, in place.
        await resealing.reseal(self._db, self._sealer, everything=False)
        resealing.check_keys(self._db, self._sealer)

    async def reseal_secrets(self) -> int:
        return await resealing.reseal(self._db, self._sealer, everything=True)

    async def close(self) -> None:
        await self._db.close()

    async def ping(self) -> None:
        self._db.read("SELECT 1")
        reason = unwritable_reason(self._db.path.parent)
        if reason is not None:  # reads still work; every accept and transition would fail
            raise StoreUnwritable(f"the SQLite store cannot be written: {reason}")

    async def clock(self) -> float:
        return now()


    # ----- accepting -------------------------------------------------------------

    async def accept(
        self, new: NewJob, idempotency: IdempotencyClaim | None = None, budget: StartBudget | None = None
    ) -> Accepted:
        """Spend a start token, write the job (queued, version 1), its key and its outbox rows: one transaction."""

        # The job as it will be if accepted, its event and work message: encoded before the
        # write lock is taken, which only the writes need (``transition`` says why).
        ts = now()
        job = new.queued_row(ts)
        unnumbered, tail = unnumbered_event(job, "job.queued")
        work = _work_message(job)

        def tx(conn: sqlite3.Connection) -> Accepted:
            held_at = now()  # the start budget and the key's expiry go by the time the lock is held
            if budget is not None:
                _spend_start_token(conn, new.tenant, budget, held_at)
            if idempotency is not None:
                row = conn.execute(
                    "SELECT fingerprint, job_id, expires_at FROM idempotency_keys WHERE tenant = ? AND key = ?",
                    (new.tenant, idempotency.key),
                ).fetchone()
                if row is not None and row["expires_at"] <= held_at:
                    conn.execute(
                        "DELETE FROM idempotency_keys WHERE tenant = ? AND key = ?", (new.tenant, idempotency.key)
                    )
                    row = None
                if row is not None:
                    if row["fingerprint"] != idempotency.fingerprint:
                        raise IdempotencyMismatch(idempotency.key)
                    existing = _fetch(conn, row["job_id"])
                    if existing is not None:
                        return Accepted(job=existing, replayed=True)
                    # The job is gone (retention) but the key lives on: answer as if new.
                    conn.execute(
                        "DELETE FROM idempotency_keys WHERE tenant = ? AND key = ?", (new.tenant, idempotency.key)
                    )
            conn.execute(
                "INSERT INTO jobs (id, tenant, kind, collection, state, params, progress, version, attempt,"
                " created_at, updated_at, deadline_at, callback_url, traceparent, tracestate)"
                " VALUES (?,?,?,?, 'queued', ?, NULL, 1, 0, ?, ?, ?, ?, ?, ?)",
                (new.id, new.tenant, new.kind, new.collection, new.params, ts, ts, ts + new.deadline_s, new.callback_url,
                 new.traceparent, new.tracestate),
            )
            if idempotency is not None:
                conn.execute(
                    "INSERT INTO idempotency_keys (tenant, key, fingerprint, job_id, created_at, expires_at)"
                    " VALUES (?,?,?,?,?,?)",
                    (new.tenant, idempotency.key, idempotency.fingerprint, new.id, held_at,
                     held_at + idempotency.ttl_s),
                )
            event = _append_unnumbered(conn, job, unnumbered, tail, self._db.origin)
            _enqueue_work(conn, job, self._db.origin, work)
            return Accepted(job=job, replayed=False, event=event)

        accepted = await self._db.write(tx)
        if accepted.event is not None:
            self._committed(accepted.job, accepted.event)
        return accepted

    async def find_replay(self, tenant: str, claim: IdempotencyClaim) -> JobRow | None:
        rows = self._db.read(
            "SELECT fingerprint, job_id FROM idempotency_keys WHERE tenant = ? AND key = ? AND expires_at > ?",
            (tenant, claim.key, now()),
        )
        if not rows:
            return None
        if rows[0]["fingerprint"] != claim.fingerprint:
            raise IdempotencyMismatch(claim.key)
        return await self.get(rows[0]["job_id"])

    # ----- the one writer of job state ---------------------------------------------

    async def transition(self, job_id: str, change: Change) -> Transition:
        """Apply ``change`` if the job is where the caller expects it, else raise TransitionRejected.

        On a row this process remembers (``recent_rows``: a worker's claim on the row it read
        for it, its success on its claim) the change is judged and encoded before the write
        lock is taken, and the transaction only compares-and-sets on that row and numbers the
        event: the judging and encoding (about a third of a transition's time) would hold
        every process's writes up otherwise (bench/RESULTS.md, issue 24). A miss (another
        writer moved the row since) is judged again on the row read under the lock."""
        judged = _judge_remembered(self._rows.get(job_id), change, self.retention_s)

        def tx(conn: sqlite3.Connection) -> Transition:
            if judged is not None:
                applied = _apply_judged(conn, judged, change, self._db.origin)
                if applied is not None:
                    return applied
            before = _fetch(conn, job_id)
            reason = refusal(before, change)
            if reason is not None:
                raise TransitionRejected(job_id, reason, before)
            assert before is not None
            if change.claim and change.max_running > 0 and _at_cap(conn, before.tenant, change.max_running):
                raise TransitionRejected(job_id, TENANT_AT_CAP, before)
            # A job's times never step back, whatever the clock does (NTP).
            after, values = changed_row(before, change, at=max(now(), before.updated_at), retention_s=self.retention_s)
            kind_of_change = event_type(before, after)
            if kind_of_change is None:
                return Transition(before=before, after=before, event=None)  # nothing visible changed
            _update_job(conn, after, values)
            event = _append_event(conn, after, kind_of_change, self._db.origin)
            if change.requeue:
                _enqueue_work(conn, after, self._db.origin)
            return Transition(before=before, after=after, event=event)

        try:
            result = await self._observed_transition(job_id, change, lambda: self._db.write(tx))
        except TransitionRejected:
            self._rows.forget(job_id)
            raise
        self._rows.saw(result.after)
        return result

    async def heartbeat(self, job_id: str, attempt: int) -> JobRow | None:
        """Move only ``updated_at``/``heartbeat_at`` (not an event). None: the worker lost the job."""

        def tx(conn: sqlite3.Connection) -> JobRow | None:
            ts = now()
            cursor = conn.execute(
                "UPDATE jobs SET heartbeat_at = ?, updated_at = ? WHERE id = ? AND state = 'running' AND attempt = ?",
                (ts, ts, job_id, attempt),
            )
            return _fetch(conn, job_id) if cursor.rowcount else None

        row = await self._db.write(tx)
        if row is None:
            self._rows.forget(job_id)
        else:
            self._rows.saw(row)  # a later transition compares-and-sets on its updated_at
        return row

    # ----- reads (on the loop: point lookups and bounded index scans) -------------------

    def remember(self, row: JobRow) -> None:
        """A row read for a transition to follow (a worker's, before its claim): the
        transition is judged on it before the write lock, unless this process saw the job since."""
        self._rows.offered(row)

    async def get(self, job_id: str) -> JobRow | None:
        rows = self._db.read("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return JobRow.from_mapping(rows[0]) if rows else None

    async def get_for_tenant(self, tenant: str, job_id: str) -> JobRow | None:
        job = await self.get(job_id)
        return job if job is not None and job.tenant == tenant else None

    async def tombstone_tenant(self, job_id: str) -> str | None:
        rows = self._db.read("SELECT tenant FROM tombstones WHERE job_id = ?", (job_id,))
        return rows[0]["tenant"] if rows else None

    async def list_jobs(
        self,
        tenant: str,
        *,
        state: str | None,
        kind: str | None,
        before: tuple[float, str] | None,
        limit: int,
    ) -> list[JobRow]:
        sql = ["SELECT * FROM jobs WHERE tenant = ?"]
        params: list[Any] = [tenant]
        if state is not None:
            sql.append("AND state = ?")
            params.append(state)
        if kind is not None:
            sql.append("AND kind = ?")
            params.append(kind)
        if before is not None:
            sql.append("AND (created_at < ? OR (created_at = ? AND id < ?))")
            params.extend([before[0], before[0], before[1]])
        sql.append("ORDER BY created_at DESC, id DESC LIMIT ?")
        params.append(limit)
        return [JobRow.from_mapping(r) for r in self._db.read(" ".join(sql), params)]

    async def job_events(self, job_id: str, after_version: int, limit: int = 1000) -> list[JobEvent]:
        rows = self._db.read(
            "SELECT * FROM events WHERE job_id = ? AND version > ? ORDER BY version LIMIT ?",
            (job_id, after_version, limit),
        )
        return [_event_from_row(r) for r in rows]

    async def tenant_events(self, tenant: str, after_seq: int, limit: int, kind: str | None = None) -> list[JobEvent]:
        if kind is None:
            rows = self._db.read(
                "SELECT * FROM events WHERE tenant = ? AND seq > ? ORDER BY seq LIMIT ?", (tenant, after_seq, limit)
            )
        else:
            rows = self._db.read(
                "SELECT * FROM events WHERE tenant = ? AND seq > ? AND kind = ? ORDER BY seq LIMIT ?",
                (tenant, after_seq, kind, limit),
            )
        return [_event_from_row(r) for r in rows]

    async def last_event_seq(self, tenant: str) -> int:
        rows = self._db.read("SELECT last FROM tenant_seq WHERE tenant = ?", (tenant,))
        return int(rows[0]["last"]) if rows else 0

    def _queued_since(self) -> dict[str, float]:
        """Each kind's oldest queued job's created_at (the kinds with none are left out)."""
        return {r["kind"]: r["since"] for r in self._db.read(_QUEUED_SINCE_BY_KIND)}

    async def stats(self) -> StoreStats:
        ts = now()
        queued = min(self._queued_since().values(), default=None)
        deleting = list(self._deleting)
        outbox = self._db.read(f"SELECT COUNT(*) AS n, MIN(created_at) AS t FROM outbox"
                               f" WHERE seq NOT IN ({','.join('?' * len(deleting))})", deleting)[0]
        waiting = self._db.read("SELECT COUNT(*) AS n, MIN(created_at) AS t FROM webhook_fan_out_waiting")[0]
        return StoreStats(
            oldest_queued_age_s=max(0.0, ts - queued) if queued is not None else 0.0,
            outbox_pending=int(outbox["n"]),
            outbox_oldest_age_s=max(0.0, ts - outbox["t"]) if outbox["t"] is not None else 0.0,
            fan_out_waiting=int(waiting["n"]),
            fan_out_waiting_age_s=max(0.0, ts - waiting["t"]) if waiting["t"] is not None else 0.0,
        )

    async def queued_ages(self, kinds: Sequence[str]) -> dict[str, float]:
        ts = now()
        since = self._queued_since()
        return {kind: max(0.0, ts - since[kind]) if kind in since else 0.0 for kind in kinds}

    async def tenant_queued_age(self, kind: str, tenant: str) -> float:
        since = self._db.read(
            "SELECT MIN(created_at) AS t FROM jobs WHERE state = 'queued' AND kind = ? AND tenant = ?", (kind, tenant)
        )[0]["t"]
        return max(0.0, now() - since) if since is not None else 0.0

    async def running_counts(self, tenants: Sequence[str]) -> dict[str, int]:
        return {
            tenant: int(self._db.read("SELECT COUNT(*) AS n FROM jobs WHERE state = 'running' AND tenant = ?",
                                      (tenant,))[0]["n"])
            for tenant in dict.fromkeys(tenants)
        }

    # ----- outbox ---------------------------------------------------------------------

    async def outbox_batch(self, limit: int, *, stale_after_s: float | None = None) -> list[OutboxRow]:
        params: tuple[object, ...]
        if stale_after_s is None:
            where, params = "origin = ?", (self._db.origin, limit)
        else:
            where, params = "created_at < ?", (now() - stale_after_s, limit)

        # On the loop, like the point reads: the outbox holds what is not yet published (a
        # few rows, at most a batch of them), cheaper to read than a hop to the writer thread.
        deleting = list(self._deleting)
        rows = self._db.read(
            f"SELECT seq, subject, msg_id, payload, traceparent, tracestate FROM outbox WHERE {where}"
            f" AND seq NOT IN ({','.join('?' * len(deleting))}) ORDER BY seq LIMIT ?",
            (*params[:-1], *deleting, params[-1]),
        )
        return [OutboxRow(seq=r["seq"], subject=r["subject"], msg_id=r["msg_id"], payload=bytes(r["payload"]),
                          traceparent=r["traceparent"], tracestate=r["tracestate"])
                for r in rows]

    async def outbox_done(self, seqs: Sequence[int]) -> None:
        """The rows leave the outbox at once for this process (never handed out again); their
        delete rides with the next transaction this process commits (``Database.write_soon``),
        so a published batch costs no commit of its own. A crash before that commit leaves
        them to a stale pass: published again, dropped by JetStream's duplicate window."""
        done = [s for s in seqs if s not in self._deleting]
        if not done:
            return
        self._deleting.update(done)

        def tx(conn: sqlite3.Connection) -> None:
            conn.executemany("DELETE FROM outbox WHERE seq = ?", [(s,) for s in done])

        def committed(future: asyncio.Future[None]) -> None:
            # Committed: the rows are gone. Failed: they are handed out (and published) again.
            self._deleting.difference_update(done)
            if not future.cancelled():
                future.exception()  # retrieved: a failed delete is not an error of anyone's

        self._db.write_soon(tx).add_done_callback(committed)

    # ----- sweeping -------------------------------------------------------------------

    async def live_jobs(self, *, stale_before: float, deadline_before: float) -> list[JobRow]:
        """Running jobs with an old heartbeat, and live jobs past their deadline."""

        def read(conn: sqlite3.Connection) -> list[JobRow]:
            rows = conn.execute(
                "SELECT * FROM jobs WHERE (state = 'queued' OR state = 'running')"
                " AND ((state = 'running' AND COALESCE(heartbeat_at, 0) < ?) OR deadline_at < ?)",
                (stale_before, deadline_before),
            ).fetchall()
            return [JobRow.from_mapping(r) for r in rows]

        return await self._db.read_in_thread(read)

    async def expired(self, at: float, limit: int = 500) -> list[JobRow]:
        """Jobs whose retention has passed; the caller removes their results, then ``forget``s them."""

        def read(conn: sqlite3.Connection) -> list[JobRow]:
            rows = conn.execute(
                "SELECT * FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ? LIMIT ?", (at, limit)
            ).fetchall()
            return [JobRow.from_mapping(r) for r in rows]

        return await self._db.read_in_thread(read)

    async def forget(self, jobs: Sequence[JobRow], at: float) -> None:
        """Delete the jobs with their history and keys, leave tombstones (410), drop expired keys."""

        def tx(conn: sqlite3.Connection) -> None:
            for job in jobs:
                conn.execute("DELETE FROM events WHERE job_id = ?", (job.id,))
                conn.execute("DELETE FROM idempotency_keys WHERE job_id = ?", (job.id,))
                conn.execute("DELETE FROM jobs WHERE id = ? AND expires_at <= ?", (job.id, at))
                conn.execute(
                    "INSERT OR REPLACE INTO tombstones (job_id, tenant, deleted_at) VALUES (?,?,?)",
                    (job.id, job.tenant, at),
                )
            conn.execute("DELETE FROM idempotency_keys WHERE expires_at <= ?", (at,))

        await self._db.write(tx)

    # ----- shared secrets ---------------------------------------------------------------

    async def signing_key(self) -> bytes:
        aad = secret_aad(_SIGNING_KEY_NAME)
        rows = self._db.read("SELECT value FROM herald_secrets WHERE name = ?", (_SIGNING_KEY_NAME,))
        if rows:
            return self._sealer.open(rows[0]["value"], aad)

        def tx(conn: sqlite3.Connection) -> bytes:
            # The first process to get here wins; the others read what it wrote.
            conn.execute("INSERT OR IGNORE INTO herald_secrets (name, value) VALUES (?, ?)",
                         (_SIGNING_KEY_NAME, self._sealer.seal(secrets.token_bytes(32), aad)))
            return bytes(conn.execute("SELECT value FROM herald_secrets WHERE name = ?",
                                      (_SIGNING_KEY_NAME,)).fetchone()[0])

        return self._sealer.open(await self._db.write(tx), aad)


def _event_from_row(row: sqlite3.Row) -> JobEvent:
    return JobEvent(
        seq=row["seq"],
        tenant=row["tenant"],
        job_id=row["job_id"],
        kind=row["kind"],
        version=row["version"],
        type=row["type"],
        at=rfc3339(row["at"]) or "",
        data=msgspec.Raw(row["data"]),
    )

