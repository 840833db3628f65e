"""The PostgreSQL job store: jobs, their history (events), the outbox, idempotency keys,
tombstones, start budgets and shared secrets, for any number of machines.

It behaves as the SQLite store (``herald.storage.sqlite.jobs``) does; what differs is how
it keeps the concurrency rules of ``herald.storage.ports`` without a database-wide lock.

**Round trips.** Every write is one statement, so it runs as one implicit transaction with
no ``BEGIN``/``COMMIT`` round trips: the multi-step writes are plpgsql functions created by
the migration (``herald_accept``, ``herald_transition``, both ending in
``herald_append_event``: insert the event, insert the outbox rows). The one thing the
database cannot compute is the event's payload: it is the status object encoded by Python
(``JobRow.status()``), and it contains the change's time, which must come from the
server's clock. So a write first reads that clock (for a transition, in the same round
trip as the row it judges), encodes, then sends the one statement; unless this process read
both recently (``recent.py``, ``herald.storage.recent_rows``): the server's clock as read at most a second ago plus the time
elapsed here since, and the job's row as this process last read or wrote it, or as the work
message carried it (``remember``: a worker's claim is judged on the queued row its message
carries, ``herald.workmessage``; its success on its claim). A transition judged on such a row
still compares-and-sets on it, so a row that moved since makes the write miss and the row is
read and judged again; a refusal is only ever said of a row just read.

* ``accept``: 1 round trip (``herald_accept``), 2 when the clock must be read first;
* ``transition``: 1 round trip (``herald_transition``) on a remembered row, else 2 (row +
  clock; ``herald_transition``), 2 more per lost race; on a remembered row with a clock read
  more than a second ago, the clock is read first, one read for every transition in flight;
* ``heartbeat``, reads, outbox, retention: 1 round trip each (``get`` reads the clock too).

(asyncpg's pool adds its reset query when a connection goes back: that is ``PgDatabase``'s
choice, one per call above however many statements it runs.)

**Numbered after commit.** An event's tenant-wide ``seq`` is not given by its write: the
write inserts the event with a global identity (``events.id``, from a sequence) and no
seq, and holds no tenant-wide lock (one would be held through the commit's WAL flush, and
a tenant's writes would go one commit at a time, however many processes write them). The
relay's ``outbox_batch`` numbers first: ``herald_number_events`` takes the tenant's
advisory lock, then numbers every committed unnumbered event of the tenant in id order,
after its ``tenant_seq.last``, and commits (the next pass of the tenant waits on the lock
for this one's numbers; a pass that finds nothing to number writes nothing). Readers read
numbered events only, by seq: see ``sql/0013_events_numbered_after_commit.sql`` for why
nothing is missed or read twice and each job keeps its order, ``sql/functions/events_numbering.sql`` for the lock. So the outbox payload of an event (the JSON ``JobEvent``, whose
first field is ``seq``) is stored without its ``{"seq":N,`` head, and ``outbox_batch``
prepends it once numbered: the bytes are exactly what ``msgspec`` would encode. A write
answers with the event at seq 0, which is what the committing process's own listeners
hear (the gateway's hub sends it to the job's streams, not to the tenant's).

**Compare-and-set.** ``transition`` judges the row it read with ``refusal()`` (the rules
live in ``herald.transitions``, in Python), then updates ``WHERE id AND version AND
updated_at`` are still what it read: ``version`` catches other transitions, ``updated_at``
catches heartbeats (which move no version but matter to ``stale_before``). On a miss it
reads again and judges again; each miss means another writer committed, so it ends.

**Locking.** No table locks. Row locks, always in one order (rate bucket, idempotency key,
job, tenant counter), so no deadlocks:

* the tenant's ``rate_buckets`` row: one start budget however many gateways draw on it;
* ``idempotency_keys``: ``INSERT ... ON CONFLICT DO NOTHING`` claims a key; the loser of a
  race waits for the winner's commit, then reads its job (replay) or its different
  fingerprint (mismatch), never a unique violation;
* the tenant's ``tenant_seq`` row: locked by a capped claim (SPEC §13), which counts the
  tenant's running jobs under it, and updated by a numbering pass that numbered something;
  never by other writes. A pass takes its tenants in byte order, the order a group commit
  sorts its statements by, so a pass and a batch of capped claims never wait in a cycle.

Retention (``forget``) never waits for a lock (``SKIP LOCKED``), so sweeps in several
gateways at once share the work instead of deadlocking with each other or with accepts.

**Clock.** Every stored time is the server's (``clock_timestamp()``), never this machine's.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import msgspec

from herald import workmessage
from herald.constants import event_subject_head, job_subject
from herald.jobs import (
    Accepted,
    IdempotencyClaim,
    IdempotencyMismatch,
    JobRow,
    NewJob,
    RateLimited,
    StoreUnavailable,
    Transition,
    TransitionRejected,
)
from herald.sealing import Sealer, secret_aad
from herald.storage.committing import CommitListeners
from herald.storage.live_scan import OLDEST_OF_TENANT_KIND, QUEUED_TENANT_KINDS
from herald.storage.ports import OutboxRow, StartBudget, StoreStats
from herald.storage.postgres import resealing
from herald.storage.postgres.db import CONNECTION_ERRORS, NOW_SQL, PgDatabase, unavailable_on_connection_errors
from herald.storage.postgres.recent import ServerClock
from herald.storage.recent_rows import RecentRows
from herald.storage.unnumbered import unnumbered_event
from herald.timefmt import rfc3339
from herald.transitions import TENANT_AT_CAP, Change, changed_row, event_type, refusal
from schemas import JobEvent


SIGNING_KEY_NAME = "url-signing"

# The seed of the 64-bit hash of a tenant's name that keys its numbering passes' advisory
# lock (sql/functions/events_numbering.sql): "HSEQ" in ASCII, so Herald's other uses of a
# hash of a name differ.
NUMBER_LOCK_SEED = 0x48534551

# The tables: sql/0001-0005, 0013 and 0016 beside this package's schema.py; the functions:
# sql/functions/jobs_writes.sql and events_numbering.sql. State names in the
# SQL below are the values of ``schemas.jobs.JobState`` (the one list), written out because a
# query must repeat a partial index's predicate literally for the planner to use the index.

# ----- statements ---------------------------------------------------------------------------

# One call, so that the accepts of one group commit go as one statement (``db._Combined``);
# its value is a ``herald_accepted`` row (migration 20), the job's row inside it.
_ACCEPT = "SELECT herald_accept(" + ", ".join(f"${n}" for n in range(1, 22)) + ")"

# The row to judge and the server's time to stamp the change with, in one round trip.
_READ_FOR_CHANGE = f"SELECT c.now, j.* FROM (SELECT {NOW_SQL} AS now) AS c LEFT JOIN jobs AS j ON j.id = $1"

_OUTBOX_BATCH = "SELECT * FROM herald_outbox_batch($1, $2, $3, $4)"
# Published rows: the delete rides in front of the first statement of this process's next
# group commit (``PgDatabase.ride``; the array fills the braces).
_OUTBOX_DELETE = "DELETE FROM outbox WHERE seq = ANY({}::bigint[])"

_TRANSITION = "SELECT herald_transition(" + ", ".join(f"${n}" for n in range(1, 23)) + ")"
_CAPPED_TRANSITION = "SELECT herald_claim_capped(" + ", ".join(f"${n}" for n in range(1, 24)) + ")"

# GREATEST: a transition that committed while this statement waited for the row keeps its
# (possibly later) time; a job's updated_at never goes back.
_HEARTBEAT = (
    "UPDATE jobs AS j SET heartbeat_at = GREATEST(c.now, j.updated_at), updated_at = GREATEST(c.now, j.updated_at)"
    f" FROM (SELECT {NOW_SQL} AS now) AS c"
    " WHERE j.id = $1 AND j.state = 'running' AND j.attempt = $2 RETURNING j.*"
)

# The oldest queued job of each (tenant, kind) that has one: a loose scan of
# jobs_live_by_tenant (herald/storage/live_scan.py).
_QUEUED_SINCE = (
    QUEUED_TENANT_KINDS
    + f",\n  queued(kind, since) AS (SELECT q.kind, {OLDEST_OF_TENANT_KIND} FROM q WHERE q.kind IS NOT NULL)\n"
)

_STATS = (
    _QUEUED_SINCE
    + f"SELECT {NOW_SQL} AS now,"
    " (SELECT MIN(since) FROM queued) AS queued_since,"
    " (SELECT COUNT(*) FROM outbox WHERE seq <> ALL($1::bigint[])) AS outbox_pending,"
    " (SELECT MIN(created_at) FROM outbox WHERE seq <> ALL($1::bigint[])) AS outbox_since,"
    " (SELECT COUNT(*) FROM webhook_fan_out_waiting) AS fan_out_waiting,"
    " (SELECT MIN(created_at) FROM webhook_fan_out_waiting) AS fan_out_since"
)

_QUEUED_AGES = (
    _QUEUED_SINCE
    + f"SELECT k.kind, {NOW_SQL} AS now,"
    " (SELECT MIN(since) FROM queued WHERE queued.kind = k.kind) AS since"
    " FROM unnest($1::text[]) AS k(kind)"
)

_TENANT_QUEUED_AGE = (
    f"SELECT {NOW_SQL} AS now,"
    " (SELECT MIN(created_at) FROM jobs WHERE state = 'queued' AND kind = $1 AND tenant = $2) AS since"
)

# One lookup in jobs_live_by_tenant per tenant.
_RUNNING_COUNTS = (
    "SELECT t.tenant, (SELECT COUNT(*) FROM jobs WHERE state = 'running' AND jobs.tenant = t.tenant) AS running"
    " FROM unnest($1::text[]) AS t(tenant)"
)

# One statement (data-modifying CTEs all run, whether or not the final SELECT reads them)
# that never waits for a lock: a job another gateway's sweep is forgetting right now is
# its to finish (SKIP LOCKED), and so is a key an accept holds (the key then outlives its
# job, which accept treats as "job gone": a new job). So two sweeps, or a sweep and an
# accept, cannot deadlock.
_FORGET = """
WITH doomed AS (
         SELECT id, tenant FROM jobs WHERE id = ANY($1::text[]) AND expires_at <= $2 FOR UPDATE SKIP LOCKED
     ),
     gone_events AS (DELETE FROM events WHERE job_id IN (SELECT id FROM doomed) RETURNING id),
     -- An event not published yet is not numbered either: nobody will, once it is gone.
     gone_outbox AS (DELETE FROM outbox WHERE event_id IN (SELECT id FROM gone_events)),
     gone_keys AS (
         DELETE FROM idempotency_keys WHERE ctid IN (
             SELECT ctid FROM idempotency_keys
             WHERE job_id IN (SELECT id FROM doomed) OR expires_at <= $2
             FOR UPDATE SKIP LOCKED)
     ),
     gone_jobs AS (DELETE FROM jobs WHERE id IN (SELECT id FROM doomed)),
     tombs AS (
         INSERT INTO tombstones (job_id, tenant, deleted_at) SELECT id, tenant, $2 FROM doomed
         ON CONFLICT (job_id) DO UPDATE SET tenant = excluded.tenant, deleted_at = excluded.deleted_at
     )
SELECT COUNT(*) FROM doomed
"""

# ----- what the statements carry ------------------------------------------------------------


def _changed_row(before: JobRow, change: Change, ts: float, retention_s: float) -> JobRow:
    """The row after ``change`` at time ``ts`` (``herald.transitions.changed_row``: one rule for both stores)."""
    return changed_row(before, change, at=ts, retention_s=retention_s)[0]


def _work_message(job: JobRow) -> tuple[str, str, bytes]:
    """Subject, Nats-Msg-Id and msgpack body of the job's work message for its current attempt."""
    # The first message's id is the job id (SPEC §3); a re-queue needs a fresh id, or
    # JetStream's duplicate window would swallow it.
    msg_id = job.id if job.attempt == 0 else f"{job.id}.a{job.attempt}"
    # The job's row rides along (``herald.workmessage``): its worker claims on it without
    # reading the job first.
    return job_subject(job.kind, job.tenant), msg_id, workmessage.encode(job, carry_row=True)


def _event_from_record(record: asyncpg.Record) -> JobEvent:
    return JobEvent(
        seq=record["seq"] or 0,  # 0: committed, not numbered yet (job_events reads those too)
        tenant=record["tenant"],
        job_id=record["job_id"],
        kind=record["kind"],
        version=record["version"],
        type=record["type"],
        at=rfc3339(record["at"]) or "",
        data=msgspec.Raw(bytes(record["data"])),
    )


def _age(now: float, since: float | None) -> float:
    return max(0.0, now - since) if since is not None else 0.0


@unavailable_on_connection_errors
class PgJobStore(CommitListeners):
    """The job store in PostgreSQL. One per process; any number of processes share the database."""

    keeps_results = True  # a small JSON result rides in the success's transaction (jobs.result_body, migration 15)

    def __init__(self, db: PgDatabase, *, retention_s: float, sealer: Sealer) -> None:
        self._db = db
        self.retention_s = retention_s
        self._sealer = sealer
        self._clock = ServerClock()
        self._rows = RecentRows()
        # Outbox rows published, whose delete waits for this process's next group commit:
        # never handed out again, nor counted as pending, meanwhile.
        self._deleting: set[int] = set()
        self._clock_read: asyncio.Future[float] | None = None  # the clock read in flight, shared
        super().__init__()

    async def open(self) -> None:
        # The factory may have started opening the database already (``open(wait=False)``,
        # so that /readyz answers 503 meanwhile); a second open() would make a second pool.
        if not self._db.opened:
            await self._db.open()
        await self._db.wait_ready()
        # A store an older Herald wrote keeps its secrets in plaintext: sealed now, in place.
        await resealing.reseal(self._db.pool, self._sealer, everything=False)
        await resealing.check_keys(self._db.pool, self._sealer)

    async def reseal_secrets(self) -> int:
        return await resealing.reseal(self._db.pool, self._sealer, everything=True)

    async def close(self) -> None:
        await self._db.close()

    async def ping(self) -> None:
        async with self._unavailable_on_errors():
            await self._db.ping()

    async def clock(self) -> float:
        """The server's clock, read now. Callers at once share one read: when a busy worker's
        remembered clock grows stale, every transition it has in flight needs it at once."""
        read = self._clock_read
        if read is None:
            read = self._clock_read = asyncio.ensure_future(self._read_clock())
            read.add_done_callback(self._clock_read_done)
        async with self._unavailable_on_errors():
            return await asyncio.shield(read)

    async def _read_clock(self) -> float:
        sent = time.monotonic()
        now = await self._db.clock()
        self._clock.read(now, sent)
        return now

    def _clock_read_done(self, read: asyncio.Future[float]) -> None:
        self._clock_read = None
        if not read.cancelled():
            read.exception()  # retrieved, if every caller gave up on it

    async def _now(self) -> float:
        """The server's time: guessed from a recent read (``ServerClock``), else read."""
        now = self._clock.now()
        return now if now is not None else await self.clock()

    async def _read_for_change(self, job_id: str) -> tuple[float, JobRow | None]:
        """The job's row and the server's time, in one round trip; both remembered."""
        sent = time.monotonic()
        record = await self._db.pool.fetchrow(_READ_FOR_CHANGE, job_id)
        assert record is not None
        now = float(record["now"])
        self._clock.read(now, sent)
        if record["id"] is None:
            self._rows.forget(job_id)
            return now, None
        row = JobRow.from_mapping(record)
        self._rows.saw(row)
        return now, row


    # ----- connections ------------------------------------------------------------------

    @asynccontextmanager
    async def _unavailable_on_errors(self) -> AsyncIterator[None]:
        """A lost or refused connection is ``StoreUnavailable`` (503, retry), like a store not open yet."""
        try:
            yield
        except CONNECTION_ERRORS as exc:
            raise StoreUnavailable(f"the PostgreSQL store is not reachable (HERALD_DATABASE_URL): {exc}") from exc

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        async with self._unavailable_on_errors():
            return await self._db.pool.fetch(sql, *args)

    async def _fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        async with self._unavailable_on_errors():
            return await self._db.pool.fetchrow(sql, *args)

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        async with self._unavailable_on_errors():
            return await self._db.pool.fetchval(sql, *args)

    # ----- accepting -------------------------------------------------------------------

    async def accept(
        self, new: NewJob, idempotency: IdempotencyClaim | None = None, budget: StartBudget | None = None
    ) -> Accepted:
        """Spend a start token, write the job (queued, version 1), its key and its outbox rows: one transaction."""
        async with self._unavailable_on_errors():
            ts = await self._now()
            job = new.queued_row(ts)
            event, event_tail = unnumbered_event(job, "job.queued")
            work_subject, work_msg_id, work_payload = _work_message(job)
            # Committed with the other accepts and transitions of this process queued meanwhile.
            record = await self._db.fetchval_grouped(
                _ACCEPT,
                new.id, new.tenant, new.kind, new.collection, new.params, new.callback_url,
                ts, float(new.deadline_s),
                idempotency.key if idempotency else None,
                idempotency.fingerprint if idempotency else None,
                float(idempotency.ttl_s) if idempotency else None,
                float(budget.rate) if budget else None,
                float(budget.burst) if budget else None,
                event_subject_head(new.tenant, new.id), bytes(event.data), event_tail,
                work_subject, work_msg_id, work_payload,
                new.traceparent, new.tracestate,
                order=new.tenant,
            )
        assert record is not None
        outcome = record["outcome"]
        if outcome == "limited":
            raise RateLimited(new.tenant, max(0.0, float(record["wait_s"])))
        if outcome == "mismatch":
            assert idempotency is not None
            raise IdempotencyMismatch(idempotency.key)
        stored = JobRow.from_mapping(record["job"])
        if outcome == "replayed":
            return Accepted(job=stored, replayed=True)
        event = msgspec.structs.replace(event, seq=record["event_seq"])
        self._rows.saw(stored)
        self._committed(stored, event)
        return Accepted(job=stored, replayed=False, event=event)

    async def find_replay(self, tenant: str, claim: IdempotencyClaim) -> JobRow | None:
        # The key's expiry is judged by the server's clock, as ``herald_accept`` judges it.
        record = await self._fetchrow(
            "SELECT k.fingerprint, j.* FROM idempotency_keys k LEFT JOIN jobs j ON j.id = k.job_id"
            f" WHERE k.tenant = $1 AND k.key = $2 AND k.expires_at > {NOW_SQL}",
            tenant, claim.key,
        )
        if record is None:
            return None
        if record["fingerprint"] != claim.fingerprint:
            raise IdempotencyMismatch(claim.key)
        return JobRow.from_mapping(record) if record["id"] is not None else None

    # ----- the one writer of job state ---------------------------------------------------

    async def transition(self, job_id: str, change: Change) -> Transition:
        """Apply ``change`` if the job is where the caller expects it, else raise TransitionRejected."""
        return await self._observed_transition(job_id, change, lambda: self._compare_and_set(job_id, change))

    async def _compare_and_set(self, job_id: str, change: Change) -> Transition:
        # One round trip when this process saw the job last (a worker's success after its
        # claim, its claim on the row its work message carried): judged on the remembered row
        # at the remembered clock (``recent.py``), which the compare-and-set checks.
        before = self._rows.get(job_id)
        now = self._clock.now()
        if now is None and before is not None and refusal(before, change) is None:
            # The row is known (a work message's, a claim's), the clock too old: the clock
            # alone is read, once for all the transitions in flight (``clock``).
            await self.clock()
            now = self._clock.now()
        async with self._unavailable_on_errors():
            while True:
                remembered = before is not None and now is not None and refusal(before, change) is None
                if not remembered:
                    now, before = await self._read_for_change(job_id)
                    reason = refusal(before, change)
                    if reason is not None:
                        raise TransitionRejected(job_id, reason, before)
                assert before is not None and now is not None
                # The server's clock may step back (NTP); a job's times never do.
                ts = max(now, before.updated_at)
                after = _changed_row(before, change, ts, self.retention_s)
                kind_of_change = event_type(before, after)
                if kind_of_change is None:
                    if remembered:  # said only of the row as it is now
                        before = None
                        continue
                    return Transition(before=before, after=before, event=None)  # nothing visible changed
                event, event_tail = unnumbered_event(after, kind_of_change)
                work_subject, work_msg_id, work_payload = _work_message(after) if change.requeue else (None, None, None)
                capped = change.claim and change.max_running > 0
                # Committed with the other transitions of this process queued meanwhile.
                seq = await self._db.fetchval_grouped(
                    _CAPPED_TRANSITION if capped else _TRANSITION,
                    *((change.max_running,) if capped else ()),
                    job_id, before.version, before.updated_at,
                    after.state, after.progress, after.attempt, after.cancel_requested,
                    after.heartbeat_at, after.error, after.result_path, after.media_type, after.result_body,
                    after.finished_at, after.expires_at, after.updated_at,
                    kind_of_change, event_subject_head(after.tenant, after.id), bytes(event.data), event_tail,
                    work_subject, work_msg_id, work_payload,
                    order=before.tenant,
                )
                if seq == -1 and remembered:  # at the cap; but the claim may be refused anyway on the row as it is now
                    before = None
                    continue
                if seq == -1:
                    raise TransitionRejected(job_id, TENANT_AT_CAP, before)
                if seq is not None:
                    self._rows.saw(after)
                    return Transition(before=before, after=after, event=msgspec.structs.replace(event, seq=seq))
                # Another writer committed between our read (or the row we remembered) and
                # our write: judge the new row.
                before = None

    async def heartbeat(self, job_id: str, attempt: int) -> JobRow | None:
        """Move only ``updated_at``/``heartbeat_at`` (not an event). None: the worker lost the job."""
        record = await self._fetchrow(_HEARTBEAT, job_id, attempt)
        if record is None:
            self._rows.forget(job_id)
            return None
        row = JobRow.from_mapping(record)
        self._rows.saw(row)
        return row

    def remember(self, row: JobRow) -> None:
        """A row learnt without a read (the work message's job as queued): the claim that
        follows is judged on it, one round trip, unless this process saw the job since."""
        self._rows.offered(row)

    # ----- reads -------------------------------------------------------------------------

    async def get(self, job_id: str) -> JobRow | None:
        # With the server's time (the clock of a transition that may follow: a worker's claim).
        async with self._unavailable_on_errors():
            return (await self._read_for_change(job_id))[1]

    async def get_for_tenant(self, tenant: str, job_id: str) -> JobRow | None:
        record = await self._fetchrow("SELECT * FROM jobs WHERE id = $1 AND tenant = $2", job_id, tenant)
        return JobRow.from_mapping(record) if record is not None else None

    async def tombstone_tenant(self, job_id: str) -> str | None:
        tenant = await self._fetchval("SELECT tenant FROM tombstones WHERE job_id = $1", job_id)
        return str(tenant) if tenant is not None else None

    async def list_jobs(
        self,
        tenant: str,
        *,
        state: str | None,
        kind: str | None,
        before: tuple[float, str] | None,
        limit: int,
    ) -> list[JobRow]:
        params: list[Any] = [tenant]

        def param(value: Any) -> str:
            params.append(value)
            return f"${len(params)}"

        sql = ["SELECT * FROM jobs WHERE tenant = $1"]
        if state is not None:
            sql.append(f"AND state = {param(state)}")
        if kind is not None:
            sql.append(f"AND kind = {param(kind)}")
        if before is not None:
            # Row comparison: created_at < t OR (created_at = t AND id < i), as the SQLite store has it.
            sql.append(f"AND (created_at, id) < ({param(float(before[0]))}, {param(before[1])})")
        sql.append(f"ORDER BY created_at DESC, id DESC LIMIT {param(limit)}")
        return [JobRow.from_mapping(r) for r in await self._fetch(" ".join(sql), *params)]

    async def job_events(self, job_id: str, after_version: int, limit: int = 1000) -> list[JobEvent]:
        records = await self._fetch(
            "SELECT * FROM events WHERE job_id = $1 AND version > $2 ORDER BY version LIMIT $3",
            job_id, after_version, limit,
        )
        return [_event_from_record(r) for r in records]

    async def tenant_events(self, tenant: str, after_seq: int, limit: int, kind: str | None = None) -> list[JobEvent]:
        # The tenant's committed events are numbered first, so a reader sees every change that
        # committed before it asked (a job that GET /jobs/{id} shows succeeded has its event in
        # the feed), not only what a relay's pass has numbered yet. The partial index on
        # unnumbered events makes that a lookup; a pass that finds nothing writes nothing.
        await self._fetchval(
            "SELECT herald_number_events($1) WHERE EXISTS (SELECT 1 FROM events WHERE tenant = $1 AND seq IS NULL)",
            tenant,
        )
        if kind is None:
            records = await self._fetch(
                "SELECT * FROM events WHERE tenant = $1 AND seq > $2 ORDER BY seq LIMIT $3", tenant, after_seq, limit
            )
        else:
            records = await self._fetch(
                "SELECT * FROM events WHERE tenant = $1 AND seq > $2 AND kind = $3 ORDER BY seq LIMIT $4",
                tenant, after_seq, kind, limit,
            )
        return [_event_from_record(r) for r in records]

    async def last_event_seq(self, tenant: str) -> int:
        last = await self._fetchval("SELECT last FROM tenant_seq WHERE tenant = $1", tenant)
        return int(last) if last is not None else 0

    async def stats(self) -> StoreStats:
        record = await self._fetchrow(_STATS, list(self._deleting))
        assert record is not None
        return StoreStats(
            oldest_queued_age_s=_age(record["now"], record["queued_since"]),
            outbox_pending=int(record["outbox_pending"]),
            outbox_oldest_age_s=_age(record["now"], record["outbox_since"]),
            fan_out_waiting=int(record["fan_out_waiting"]),
            fan_out_waiting_age_s=_age(record["now"], record["fan_out_since"]),
        )

    async def queued_ages(self, kinds: Sequence[str]) -> dict[str, float]:
        records = await self._fetch(_QUEUED_AGES, list(kinds))
        return {r["kind"]: _age(r["now"], r["since"]) for r in records}

    async def tenant_queued_age(self, kind: str, tenant: str) -> float:
        record = await self._fetchrow(_TENANT_QUEUED_AGE, kind, tenant)
        assert record is not None
        return _age(record["now"], record["since"])

    async def running_counts(self, tenants: Sequence[str]) -> dict[str, int]:
        records = await self._fetch(_RUNNING_COUNTS, list(dict.fromkeys(tenants)))
        return {r["tenant"]: int(r["running"]) for r in records}

    # ----- outbox ------------------------------------------------------------------------

    async def outbox_batch(self, limit: int, *, stale_after_s: float | None = None) -> list[OutboxRow]:
        # One round trip: the batch's events are numbered first (herald_number_events, a
        # short transaction under each of their tenants' counter rows), so each event row
        # comes back with its seq in its payload. Rows of different processes commit out of
        # outbox order, and a later batch picks up a lower seq that committed late (rows
        # are deleted by seq, never by range).
        records = await self._fetch(_OUTBOX_BATCH, self._db.origin,
                                    None if stale_after_s is None else float(stale_after_s), limit,
                                    list(self._deleting))
        return [OutboxRow(seq=r["seq"], subject=r["subject"], msg_id=r["msg_id"], payload=bytes(r["payload"]),
                          traceparent=r["traceparent"], tracestate=r["tracestate"])
                for r in records]

    async def outbox_done(self, seqs: Sequence[int]) -> None:
        """With the next group commit, as before, but no statement of its own: the delete rides
        in front of the batch's first statement (``PgDatabase.ride``), so a published batch
        costs no statement, round trip or send of its own, and the batch it joins no
        ``BEGIN``/``COMMIT`` it would not have paid anyway."""
        done = [s for s in seqs if s not in self._deleting]
        if not done:
            return
        self._deleting.update(done)  # a stale pass meanwhile does not hand them out again
        try:
            async with self._unavailable_on_errors():
                await self._db.ride(_OUTBOX_DELETE, done)
        finally:
            self._deleting.difference_update(done)  # gone; or, failed, published again

    # ----- sweeping and retention -------------------------------------------------------

    async def live_jobs(self, *, stale_before: float, deadline_before: float) -> list[JobRow]:
        """Running jobs with an old heartbeat, and live jobs past their deadline."""
        records = await self._fetch(
            "SELECT * FROM jobs WHERE state IN ('queued', 'running')"
            " AND ((state = 'running' AND COALESCE(heartbeat_at, 0) < $1) OR deadline_at < $2)",
            float(stale_before), float(deadline_before),
        )
        return [JobRow.from_mapping(r) for r in records]

    async def expired(self, at: float, limit: int = 500) -> list[JobRow]:
        """Jobs whose retention has passed; the caller removes their results, then ``forget``s them."""
        records = await self._fetch(
            "SELECT * FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= $1 ORDER BY expires_at LIMIT $2",
            float(at), limit,
        )
        return [JobRow.from_mapping(r) for r in records]

    async def forget(self, jobs: Sequence[JobRow], at: float) -> None:
        """Delete the jobs with their history and keys, leave tombstones (410), drop expired keys.

        Only jobs whose retention ended by ``at`` (as ``expired`` listed them), so a job is
        never left half-forgotten."""
        await self._fetchval(_FORGET, list({job.id for job in jobs}), float(at))

    # ----- shared secrets ----------------------------------------------------------------

    async def signing_key(self) -> bytes:
        select = "SELECT value FROM herald_secrets WHERE name = $1"
        aad = secret_aad(SIGNING_KEY_NAME)
        value = await self._fetchval(select, SIGNING_KEY_NAME)
        if value is None:
            # The first process to get here wins; the others' inserts do nothing (each waits
            # for a racing insert to commit first), and every one reads the winner's key.
            await self._fetchval(
                "INSERT INTO herald_secrets (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
                SIGNING_KEY_NAME, self._sealer.seal(secrets.token_bytes(32), aad).hex(),
            )
            value = await self._fetchval(select, SIGNING_KEY_NAME)
        return self._sealer.open(bytes.fromhex(value), aad)
