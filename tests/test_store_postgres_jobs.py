"""The PostgreSQL job store's own mechanics, against a real server, with real concurrency.

What every backend promises (idempotency, compare-and-set, ordered history, one budget,
retention) is checked once per backend in ``tests/store_contract/test_jobs.py``. Here
stays what only this backend has: another process committing between a transition's read
and its write (the compare-and-set's retry), the server's clock, migrations under an
advisory lock, group commit, and lock order across processes. Each test gets a fresh
database on the session's server (``postgres_server`` in conftest).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest

from herald import workmessage
from herald.constants import event_subject_head
from herald.jobs import (
    Accepted, IdempotencyMismatch, JobRow, NewJob, RateLimited, StoreUnavailable, TransitionRejected,
)
from herald.storage.unnumbered import unnumbered_event
from herald.storage.postgres.db import NOW_SQL, PgDatabase
from herald.storage.postgres import jobs as pg_jobs
from herald.storage.postgres.jobs import PgJobStore
from herald.storage.postgres.recent import ServerClock
from herald.storage.ports import StartBudget
from herald.storage.postgres.schema import SCHEMA
from herald.transitions import Change
from launcher.pgserver import PostgresServer
from schemas import JobEvent, JobMessage
from workers.runner import job_of
from tests.harness import make_sealer
from tests.test_migrations import legacy_pg
from tests.store_contract.support import CLAIM, claim_key, new_job, outcomes, running_job


def new_store(url: str, *, retention_s: float = 60.0, max_size: int = 20) -> PgJobStore:
    return PgJobStore(PgDatabase(url, SCHEMA, max_size=max_size), retention_s=retention_s, sealer=make_sealer())


@pytest.fixture()
async def pg(fresh_database: str) -> AsyncIterator[PgJobStore]:
    s = new_store(fresh_database)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def db_clock(url: str) -> float:
    conn = await asyncpg.connect(url)
    try:
        return float(await conn.fetchval(f"SELECT {NOW_SQL}"))
    finally:
        await conn.close()


def run_in_other_process_like(url: str, work: Callable[[PgJobStore], Awaitable[Any]]) -> Any:
    """Run ``work`` on a store with its own loop and pool, to completion, from sync code:
    another process committing while this one sits between its read and its write."""
    result: list[Any] = []

    async def main() -> None:
        other = new_store(url, max_size=1)
        await other.open()
        try:
            result.append(await work(other))
        finally:
            await other.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()))
    thread.start()
    thread.join(30)
    assert result, "the other store's work did not finish"
    return result[0]


# ----- compare-and-set: another process between read and write -----------------------------


async def test_a_heartbeat_between_read_and_write_makes_the_sweeper_judge_again(
    pg: PgJobStore, fresh_database: str
) -> None:
    """The sweeper judged an old heartbeat; the worker beat before the sweeper wrote: no requeue."""
    job = await running_job(pg)
    # The heartbeat the sweeper reads is stale; the one the worker sends meanwhile is not.
    stale_before = await pg.clock() + 0.2
    judged: list[JobRow] = []

    def beat_meanwhile(row: JobRow) -> str | None:
        judged.append(row)
        if len(judged) == 1:
            beat = run_in_other_process_like(fresh_database, lambda other: other.heartbeat(job.id, 1))
            assert beat is not None and beat.version == row.version
        return None

    sweep = Change(expect={"running"}, to="queued", attempt=1, requeue=True, stale_before=stale_before,
                   extra_check=beat_meanwhile)
    # The new heartbeat is later than stale_before only if the clock passes it: wait for it.
    while await pg.clock() <= stale_before:
        await asyncio.sleep(0.05)
    with pytest.raises(TransitionRejected, match="heartbeat is fresh"):
        await pg.transition(job.id, sweep)
    assert len(judged) == 1  # judged once, missed the compare-and-set, re-read and refused
    current = await pg.get(job.id)
    assert current is not None and current.state == "running" and current.version == job.version


async def test_a_transition_between_read_and_write_is_not_overwritten(pg: PgJobStore, fresh_database: str) -> None:
    job = await running_job(pg)
    seen: list[int] = []

    def cancel_meanwhile(row: JobRow) -> str | None:
        seen.append(row.version)
        if len(seen) == 1:
            run_in_other_process_like(
                fresh_database,
                lambda other: other.transition(job.id, Change(expect={"running"}, to="cancelled", attempt=1)),
            )
        return None

    with pytest.raises(TransitionRejected, match="state is cancelled"):
        await pg.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1,
                                              extra_check=cancel_meanwhile))
    assert seen == [2]
    final = await pg.get(job.id)
    assert final is not None and (final.state, final.version) == ("cancelled", 3)


# ----- a transition judged on the row this process saw last ---------------------------------


def count_round_trips(pg: PgJobStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements ``pg`` sends from now on: reads on its pool, writes by group commit."""
    sent: list[str] = []
    db = pg._db

    def counting(name: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def counted(sql: str, *args: Any, **kwargs: Any) -> Any:
            sent.append(f"{name} {sql.split('(')[0]}")
            return await call(sql, *args, **kwargs)
        return counted

    class CountingPool:  # asyncpg's Pool has slots: its methods cannot be replaced on it
        def __init__(self, pool: asyncpg.Pool) -> None:
            self._pool = pool
            for name in ("fetch", "fetchrow", "fetchval"):
                setattr(self, name, counting(name, getattr(pool, name)))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._pool, name)

    counted_pool = CountingPool(db.pool)
    monkeypatch.setattr(PgDatabase, "pool", property(lambda self: counted_pool if self is db else self._pool))
    monkeypatch.setattr(db, "fetchval_grouped", counting("fetchval_grouped", db.fetchval_grouped))
    return sent


async def test_a_workers_claim_and_success_are_one_round_trip_each(
    pg: PgJobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads the job, claims it, succeeds: the claim is judged on the row just read,
    the success on the claimed row, each at the server's clock as last read plus the time
    since, so each is its write alone. A start after a recent clock read is one too."""
    job = (await pg.accept(new_job())).job
    before = await pg.clock()
    sent = count_round_trips(pg, monkeypatch)
    seen = await pg.get(job.id)
    assert seen == job and len(sent) == 1
    running = (await pg.transition(job.id, CLAIM)).after
    done = (await pg.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1))).after
    assert [s.split()[0] for s in sent] == ["fetchrow", "fetchval_grouped", "fetchval_grouped"]
    second = (await pg.accept(new_job())).job
    assert [s.split()[0] for s in sent[3:]] == ["fetchval_grouped"]
    after = await db_clock(pg._db.url)
    assert before <= running.updated_at <= done.updated_at <= after
    assert before <= second.created_at <= after
    assert await pg.get(job.id) == done and done.state == "succeeded"


class ServerLog:
    """The statements one backend sent, as the server logged them (``log_statement = all`` in
    that session; the test server's ``log_line_prefix`` names the backend's pid)."""

    _LINE = re.compile(r"\[(\d+)\] LOG:  (?:statement|execute [^:]*): (.*)")

    def __init__(self, path: Path, pid: int) -> None:
        self._path, self._pid, self._offset = path, pid, 0

    def mark(self) -> None:
        self._offset = self._path.stat().st_size

    def since_mark(self) -> list[str]:
        with open(self._path, "rb") as log:
            log.seek(self._offset)
            lines = log.read().decode("utf-8", "replace").splitlines()
        return [m.group(2) for m in map(self._LINE.search, lines) if m is not None and int(m.group(1)) == self._pid]


async def test_a_claim_from_a_message_that_carries_its_job_sends_one_statement(
    pg: PgJobStore, fresh_database: str, postgres_server: PostgresServer
) -> None:
    """The work message carries its job as queued (``herald.workmessage``), and the worker's
    claim is judged on that row: counted at the server, the claim path sends the claim
    alone, no read before it. A message without the row (an older Herald's) reads first. A
    job cancelled since its message was made: the compare-and-set misses, then the read, and
    the claim is refused on the row as it is (the message is acked, nothing runs)."""
    worker = new_store(fresh_database, max_size=1)  # one connection: the claim path's statements are one backend's
    await worker.open()
    try:
        jobs = [(await pg.accept(new_job())).job for _ in range(4)]
        messages = {w.job_id: w for w in (workmessage.decode(r.payload)
                                          for r in await pg.outbox_batch(100) if not r.msg_id.startswith("ev."))}
        assert all(workmessage.carried_row(messages[j.id]) == replace(j, callback_url=None) for j in jobs)
        await worker._db.pool.execute("SET log_statement = 'all'")
        log = ServerLog(postgres_server.log_path, await worker._db.pool.fetchval("SELECT pg_backend_pid()"))
        capped = Change(expect={"queued"}, to="running", claim=True, max_running=10)

        async def claim_path(work: JobMessage, change: Change) -> list[str]:
            await worker.clock()  # a busy worker's clock was read within the second (ServerClock)
            log.mark()
            job = await job_of(work, worker)
            assert job is not None
            try:
                await worker.transition(job.id, change)
            finally:
                sent = log.since_mark()
            return sent

        # The first claim of the connection prepares its statement; counted from the second.
        await claim_path(messages[jobs[0].id], CLAIM)
        (alone,) = await claim_path(messages[jobs[1].id], CLAIM)
        assert alone.startswith("SELECT herald_transition("), alone
        (capped_alone,) = await claim_path(messages[jobs[2].id], capped)
        assert capped_alone.startswith("SELECT herald_claim_capped("), capped_alone

        older = msgspec.structs.replace(messages[jobs[3].id], job=None)
        read, claim = await claim_path(older, CLAIM)
        assert read.startswith("SELECT c.now, j.* FROM") and claim.startswith("SELECT herald_transition("), (read, claim)

        # Cancelled after its message was made (by another process): refused on the row as it is.
        cancelled = (await pg.accept(new_job())).job
        (work,) = [workmessage.decode(r.payload) for r in await pg.outbox_batch(100) if r.msg_id == cancelled.id]
        now_cancelled = (await pg.transition(cancelled.id, Change(expect={"queued"}, to="cancelled"))).after
        with pytest.raises(TransitionRejected, match="state is cancelled") as refused:
            await claim_path(work, CLAIM)
        assert refused.value.current == now_cancelled
        missed, read_again = log.since_mark()
        assert missed.startswith("SELECT herald_transition(") and read_again.startswith("SELECT c.now, j.* FROM")
        assert await pg.get(cancelled.id) == now_cancelled
    finally:
        await worker.close()


async def test_claims_on_carried_rows_with_an_old_clock_share_one_clock_read(
    pg: PgJobStore, fresh_database: str, postgres_server: PostgresServer
) -> None:
    """A busy worker's remembered clock grows old (a second) while it has claims in flight on
    the rows their messages carried: the clock alone is read, once for all of them, and no
    job's row is read; the claims then go as one statement (group commit)."""
    worker = new_store(fresh_database, max_size=1)
    await worker.open()
    try:
        jobs = [(await pg.accept(new_job())).job for _ in range(3)]
        works = [workmessage.decode(r.payload) for r in await pg.outbox_batch(100) if not r.msg_id.startswith("ev.")]
        await worker._db.pool.execute("SET log_statement = 'all'")
        log = ServerLog(postgres_server.log_path, await worker._db.pool.fetchval("SELECT pg_backend_pid()"))
        await worker.transition(jobs[0].id, CLAIM)  # prepares the statements (read, clock, claim) on the connection
        await worker.clock()
        worker._clock = ServerClock()  # read more than a second ago: forgotten
        log.mark()
        carried = [await job_of(w, worker) for w in works if w.job_id != jobs[0].id]
        claimed = await asyncio.gather(*(worker.transition(job.id, CLAIM) for job in carried if job is not None))
        assert [c.after.state for c in claimed] == ["running"] * 2
        sent = log.since_mark()
        assert sent[0] == f"SELECT {NOW_SQL}" and not [q for q in sent if q.startswith("SELECT c.now")], sent
        assert len(sent) == 2 and sent[1].count("herald_transition(") == 2, sent
    finally:
        await worker.close()


async def test_a_remembered_row_that_moved_is_read_and_judged_again(pg: PgJobStore, fresh_database: str) -> None:
    """Another process changed the job since this one saw it: the compare-and-set on the
    remembered row misses, and the change is judged on the row as it is, never refused on
    the remembered one."""
    job = (await pg.accept(new_job())).job
    assert await pg.get(job.id) == job  # remembered: queued
    claimed = run_in_other_process_like(fresh_database, lambda other: other.transition(job.id, CLAIM))
    with pytest.raises(TransitionRejected, match="state is running") as refused:
        await pg.transition(job.id, CLAIM)
    assert refused.value.current == claimed.after

    mine = await running_job(pg)  # remembered: running, version 2
    asked = Change(expect={"running"}, attempt=1, cancel_requested=True)
    run_in_other_process_like(fresh_database, lambda other: other.transition(mine.id, asked))
    done = await pg.transition(mine.id, Change(expect={"running"}, to="succeeded", attempt=1))
    assert (done.before.version, done.after.version, done.after.cancel_requested) == (3, 4, True)
    assert [e.version for e in await pg.job_events(mine.id, 0)] == [1, 2, 3, 4]

    # Refused on the remembered row (attempt 1), allowed on the row as it is (attempt 2).
    third = await running_job(pg)

    async def requeue_and_claim(other: PgJobStore) -> JobRow:
        await other.transition(third.id, Change(expect={"running"}, to="queued", attempt=1, requeue=True))
        return (await other.transition(third.id, CLAIM)).after

    again = run_in_other_process_like(fresh_database, requeue_and_claim)
    assert again.attempt == 2
    moved = await pg.transition(third.id, Change(expect={"running"}, attempt=2, progress=10))
    assert (moved.before, moved.after.progress, moved.after.version) == (again, 10, 5)


# ----- schema, clock, group commit -------------------------------------------------------


async def test_concurrent_opens_migrate_the_schema_once(fresh_database: str) -> None:
    dbs = [PgDatabase(fresh_database, SCHEMA, max_size=2) for _ in range(10)]
    try:
        await asyncio.gather(*(db.open() for db in dbs))
        applied = await dbs[0].pool.fetch("SELECT version FROM herald_schema_migrations ORDER BY version")
        assert [r["version"] for r in applied] == [m.version for m in SCHEMA.migrations]
        pg = PgJobStore(dbs[3], retention_s=1.0, sealer=make_sealer())
        await pg.open()  # already open: no second pool
        assert (await pg.accept(new_job())).job.version == 1
    finally:
        await asyncio.gather(*(db.close() for db in dbs))


async def test_unopened_store_is_unavailable(fresh_database: str) -> None:
    pg = new_store(fresh_database)
    with pytest.raises(StoreUnavailable):
        await pg.get("x")
    with pytest.raises(StoreUnavailable):
        await pg.accept(new_job())


async def test_times_come_from_the_database_clock(
    pg: PgJobStore, fresh_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1000.0)  # this machine's clock is wrong
    before = await db_clock(fresh_database)
    assert before > 1_600_000_000
    job = (await pg.accept(new_job())).job
    running = (await pg.transition(job.id, CLAIM)).after
    beat = await pg.heartbeat(job.id, 1)
    clock = await pg.clock()
    after = await db_clock(fresh_database)

    assert beat is not None
    for t in (job.created_at, running.updated_at, running.heartbeat_at, beat.updated_at, clock):
        assert t is not None and before <= t <= after
    assert job.deadline_at == pytest.approx(job.created_at + 600.0)
    assert job.created_at <= running.updated_at <= beat.updated_at <= clock


async def test_grouped_statements_each_get_their_own_outcome(pg: PgJobStore) -> None:
    """Group commit: statements queued together commit together, and one that fails fails alone."""
    db = pg._db  # the store's own database: the transitions' group commit
    await db.pool.execute("CREATE TABLE grouped (n INTEGER PRIMARY KEY)")

    async def insert(n: int) -> int:
        return int(await db.fetchval_grouped("INSERT INTO grouped (n) VALUES ($1) RETURNING n", n))

    outcomes = await asyncio.gather(*(insert(n) for n in range(1, 41)), insert(7),  # 7 twice: a unique violation
                                    db.fetchval_grouped("SELECT 1 / 0"), return_exceptions=True)
    assert outcomes[:40] == list(range(1, 41))
    assert isinstance(outcomes[40], asyncpg.UniqueViolationError)
    assert isinstance(outcomes[41], asyncpg.DivisionByZeroError)
    assert sorted(r["n"] for r in await db.pool.fetch("SELECT n FROM grouped")) == list(range(1, 41))


async def test_a_statement_grouped_alone_is_its_own_transaction_in_one_round_trip(pg: PgJobStore) -> None:
    """A batch of one is sent without BEGIN and COMMIT (two round trips and two sends of
    three): the server commits it as its own implicit transaction. Statements queued
    together still share one transaction (one WAL flush)."""
    db = pg._db
    # SAVEPOINT is refused outside a transaction block: a BEGIN sent first would open one.
    with pytest.raises(asyncpg.NoActiveSQLTransactionError):
        await db.fetchval_grouped("SAVEPOINT alone")
    together = await asyncio.gather(*(db.fetchval_grouped("SELECT pg_current_xact_id()::text") for _ in range(3)))
    assert len(set(together)) == 1


async def test_a_statement_queued_while_a_batch_waits_is_sent_without_waiting_for_it(
    pg: PgJobStore, fresh_database: str
) -> None:
    """Two batches of a process are under way at once (``BATCHES_IN_FLIGHT``): a statement
    queued while the last batch waits in the server (for its WAL flush, or here for a lock)
    goes at once on another connection, and its caller hears back before that batch ends;
    a third waits for one of the two."""
    db = pg._db
    holder = await asyncpg.connect(fresh_database)
    try:
        await holder.execute("SELECT pg_advisory_lock(4242)")
        held = asyncio.ensure_future(db.fetchval_grouped("SELECT pg_advisory_xact_lock(4242)::text"))
        await _until(lambda: _waiting_for_advisory_lock(holder), "the first batch waiting in the server")
        assert await asyncio.wait_for(db.fetchval_grouped("SELECT 'second'"), timeout=10) == "second"
        assert not held.done()
        other_held = asyncio.ensure_future(db.fetchval_grouped("SELECT pg_advisory_xact_lock(4242)::text"))
        await _until(lambda: _waiting_for_advisory_lock(holder, 2), "two batches waiting in the server")
        third = asyncio.ensure_future(db.fetchval_grouped("SELECT 'third'"))
        await asyncio.sleep(0.2)  # a third batch would have been sent by now: it waits for a free one
        assert not third.done()
        await holder.execute("SELECT pg_advisory_unlock(4242)")
        assert await asyncio.wait_for(asyncio.gather(held, other_held, third), timeout=10) == ["", "", "third"]
    finally:
        await holder.close()


async def _waiting_for_advisory_lock(conn: asyncpg.Connection, sessions: int = 1) -> bool:
    waiting = await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'")
    return int(waiting) >= sessions


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _record_outbox_deletes(url: str) -> None:
    """A trigger that writes down, for each outbox row deleted, the top-level statement that
    deleted it (``current_query()``: the text the client sent) and its transaction."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("""
            CREATE TABLE outbox_deletes (seq BIGINT, query TEXT, xid TEXT);
            CREATE FUNCTION record_outbox_delete() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO outbox_deletes VALUES (OLD.seq, current_query(), pg_current_xact_id()::text);
                RETURN OLD;
            END $$;
            CREATE TRIGGER outbox_deleted AFTER DELETE ON outbox FOR EACH ROW EXECUTE FUNCTION record_outbox_delete();
        """)
    finally:
        await conn.close()


async def _outbox_deletes(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch("SELECT seq, query, xid FROM outbox_deletes ORDER BY seq"))
    finally:
        await conn.close()


async def test_published_rows_are_deleted_in_front_of_the_next_statement(pg: PgJobStore, fresh_database: str) -> None:
    """The relay's delete of published rows joins the next group commit, as a statement
    would, but is no statement of its own: it goes in front of the batch's first statement
    (here a worker's claim), in that statement's text, so it costs no round trip or send, and
    the claim and the delete are no batch of two (BEGIN, two statements, COMMIT)."""
    await _record_outbox_deletes(fresh_database)
    job = (await pg.accept(new_job())).job
    published = await pg.outbox_batch(100)
    assert len(published) == 2  # the event and the work message
    _, claimed = await asyncio.gather(pg.outbox_done([r.seq for r in published]), pg.transition(job.id, CLAIM))
    deletes = await _outbox_deletes(fresh_database)
    assert [d["seq"] for d in deletes] == [r.seq for r in published]
    for delete in deletes:
        assert delete["query"].startswith("WITH _rider AS (DELETE FROM outbox"), delete["query"]
        assert "herald_transition(" in delete["query"], delete["query"]  # the claim's own statement
    (row,) = await pg._db.pool.fetch("SELECT xmin::text AS xid FROM jobs WHERE id = $1", job.id)
    assert {d["xid"] for d in deletes} == {row["xid"]}  # one transaction: one commit, one WAL flush
    assert claimed.after.state == "running"
    assert [r.msg_id for r in await pg.outbox_batch(100)] == [f"ev.{job.id}.2"]


async def test_a_delete_with_nothing_to_ride_goes_alone_at_once(pg: PgJobStore, fresh_database: str) -> None:
    """Nothing else queued: the delete is a statement of its own, sent at once; the rows are
    gone when ``outbox_done`` returns."""
    await _record_outbox_deletes(fresh_database)
    await pg.accept(new_job())
    published = await pg.outbox_batch(100)
    await pg.outbox_done([r.seq for r in published])
    deletes = await _outbox_deletes(fresh_database)
    assert [d["seq"] for d in deletes] == [r.seq for r in published]
    assert {d["query"] for d in deletes} == {"DELETE FROM outbox WHERE seq = ANY($1::bigint[])"}
    assert await pg.outbox_batch(100, stale_after_s=0) == []


async def test_a_batch_of_function_calls_is_one_statement_without_begin_and_commit(pg: PgJobStore) -> None:
    """Statements queued together that are each one function call go to the server as one
    statement (``SELECT f($1) AS r0, f($2) AS r1, ...``): one round trip and one implicit
    transaction for the batch, not a round trip per statement plus BEGIN and COMMIT. Each
    caller still hears its own outcome, and one that fails fails alone."""
    db = pg._db
    await db.pool.execute("""
        CREATE FUNCTION herald_seen(n INTEGER) RETURNS TEXT LANGUAGE sql VOLATILE AS $$
            SELECT n || ' ' || current_query() $$;
        CREATE FUNCTION herald_tenth(n INTEGER) RETURNS INTEGER LANGUAGE sql VOLATILE AS $$ SELECT 10 / n $$;
    """)
    seen = await asyncio.gather(*(db.fetchval_grouped("SELECT herald_seen($1)", n) for n in range(3)))
    numbers, queries = zip(*(s.split(" ", 1) for s in seen))
    assert numbers == ("0", "1", "2")  # each caller its own value
    assert len(set(queries)) == 1 and "AS r2" in queries[0], queries  # one statement for the three
    outcomes = await asyncio.gather(*(db.fetchval_grouped("SELECT herald_tenth($1)", n) for n in (1, 2, 0, 5)),
                                    return_exceptions=True)
    assert outcomes[:2] == [10, 5] and outcomes[3] == 2
    assert isinstance(outcomes[2], asyncpg.DivisionByZeroError)

    # A worker's claims queued together: one statement, the relay's delete in front of it.
    await _record_outbox_deletes(pg._db.url)
    jobs = [(await pg.accept(new_job())).job for _ in range(3)]
    published = await pg.outbox_batch(100)
    _, *claimed = await asyncio.gather(pg.outbox_done([r.seq for r in published]),
                                       *(pg.transition(job.id, CLAIM) for job in jobs))
    assert [c.after.state for c in claimed] == ["running"] * 3
    deletes = await _outbox_deletes(pg._db.url)
    assert len(deletes) == len(published) == 6
    assert len({d["query"] for d in deletes}) == 1
    query = deletes[0]["query"]
    assert query.startswith("WITH _rider AS (DELETE FROM outbox") and query.count("herald_transition(") == 3, query


async def test_starts_queued_together_are_one_statement_each_with_its_own_outcome(
    pg: PgJobStore, fresh_database: str
) -> None:
    """A gateway's accepts queued together go to the server as one statement, as a worker's
    transitions do (``herald_accept`` returns a named row type since migration 20: the driver
    decodes that in a select list, not an anonymous record holding a job's row). Each caller
    hears its own outcome: a new job, a replayed Idempotency-Key, a key reused with other
    content, a start over its tenant's budget."""
    first = await pg.accept(new_job(), claim_key("k1"))
    conn = await asyncpg.connect(fresh_database)
    try:
        await conn.execute("""
            CREATE TABLE job_inserts (id TEXT, query TEXT);
            CREATE FUNCTION record_job_insert() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO job_inserts VALUES (NEW.id, current_query());
                RETURN NEW;
            END $$;
            CREATE TRIGGER job_inserted AFTER INSERT ON jobs FOR EACH ROW EXECUTE FUNCTION record_job_insert();
        """)
        budget = StartBudget(rate=0.0, burst=1.0)
        news = [new_job(), new_job("t9"), new_job("t9"), new_job()]
        results = await outcomes([
            pg.accept(news[0]),
            pg.accept(news[1], None, budget),
            pg.accept(news[2], None, budget),  # the bucket's one token went to the start before
            pg.accept(new_job(), claim_key("k1")),
            pg.accept(new_job(), claim_key("k1", "POST /reports {\"other\": 1}")),
            pg.accept(news[3]),
        ])
        inserts = list(await conn.fetch("SELECT id, query FROM job_inserts"))
    finally:
        await conn.close()
    new0, t9_first, t9_second, replay, mismatch, new3 = results
    assert isinstance(new0, Accepted) and not new0.replayed and new0.job.id == news[0].id
    assert isinstance(t9_first, Accepted) and t9_first.job.tenant == "t9"
    assert isinstance(t9_second, RateLimited)
    assert isinstance(replay, Accepted) and replay.replayed and replay.job == first.job
    assert isinstance(mismatch, IdempotencyMismatch)
    assert isinstance(new3, Accepted) and new3.job == await pg.get(news[3].id)
    assert {r["id"] for r in inserts} == {news[0].id, news[1].id, news[3].id}
    assert len({r["query"] for r in inserts}) == 1 and inserts[0]["query"].count("herald_accept(") == 6


async def _deadlocks(url: str) -> int:
    """Deadlocks PostgreSQL detected in this database, once every other session has ended
    (a session reports its counts when it exits)."""
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + 30
        while await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                  " AND pid <> pg_backend_pid()") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        return int(await conn.fetchval("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"))
    finally:
        await conn.close()


async def test_two_processes_group_commits_over_many_tenants_do_not_deadlock(fresh_database: str) -> None:
    """Each process commits what it has queued in one transaction, holding each tenant's
    counter row to the end; a gateway's batch of accepts and a worker's batch of transitions
    of the same tenants, queued in opposite orders, commit without a deadlock (each one
    stalled both for a second: ten tenants' throughput fell to a third)."""
    tenants = [f"t{i}" for i in range(8)]
    gateway, worker = new_store(fresh_database), new_store(fresh_database)
    await asyncio.gather(gateway.open(), worker.open())
    try:
        for _round in range(5):
            running = [await running_job(worker, t) for t in reversed(tenants)]
            results = await outcomes(
                [gateway.accept(new_job(t)) for t in tenants]
                + [worker.transition(job.id, Change(expect={"running"}, attempt=1, progress=50)) for job in running]
            )
            assert not [r for r in results if isinstance(r, BaseException)], results
    finally:
        await asyncio.gather(gateway.close(), worker.close())
    assert await _deadlocks(fresh_database) == 0  # a fresh database


# ----- events numbered after commit (issue 24) ---------------------------------------------


async def test_a_writer_held_open_is_numbered_after_it_commits_and_never_skipped(
    pg: PgJobStore, fresh_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tenant-wide lock is held through a commit: while one transition's transaction
    stays open, the tenant's later events commit, are numbered and read; the held one is
    numbered once it commits, after them, so a reader following its cursor gets it too."""
    slow_job = await running_job(pg)
    held = await asyncpg.connect(fresh_database, server_settings={"herald.origin": pg._db.origin})
    inside, release = asyncio.Event(), asyncio.Event()

    async def held_open(sql: str, *args: Any, order: str = "") -> Any:
        async with held.transaction():
            value = await held.fetchval(sql, *args)
            inside.set()
            await release.wait()
        return value

    monkeypatch.setattr(pg._db, "fetchval_grouped", held_open)
    slow = asyncio.create_task(pg.transition(slow_job.id, Change(expect={"running"}, attempt=1, progress=10)))
    await asyncio.wait_for(inside.wait(), 10)
    monkeypatch.undo()

    other = new_store(fresh_database)
    await other.open()
    try:
        fast = [await running_job(other) for _ in range(3)]
        await other.outbox_batch(100)  # the relay's pass numbers them; the held event is not visible
        feed = await other.tenant_events("t1", 0, 100)
        assert [(e.job_id, e.version) for e in feed] == [(slow_job.id, 1), (slow_job.id, 2)] + [
            (job.id, v) for job in fast for v in (1, 2)]
        assert [e.seq for e in feed] == list(range(1, 9))
        cursor = feed[-1].seq

        release.set()
        assert (await slow).after.version == 3
        await pg.outbox_batch(100)
        later = await other.tenant_events("t1", cursor, 100)
        assert [(e.seq, e.job_id, e.version) for e in later] == [(9, slow_job.id, 3)]
        assert await other.last_event_seq("t1") == 9
    finally:
        await other.close()
        await held.close()


async def test_one_tenants_writes_commit_side_by_side(pg: PgJobStore, fresh_database: str) -> None:
    """Two of one tenant's transitions in transactions of their own commit while both are
    open: neither waits for the other (before issue 24 the second waited on the tenant's
    counter row until the first committed)."""
    jobs = [await running_job(pg) for _ in range(2)]
    conns = [await asyncpg.connect(fresh_database, server_settings={"herald.origin": pg._db.origin}) for _ in jobs]
    inside = [asyncio.Event() for _ in jobs]
    release = asyncio.Event()
    calls = iter(range(len(jobs)))

    async def own_transaction(sql: str, *args: Any, order: str = "") -> Any:
        n = next(calls)
        async with conns[n].transaction():
            value = await conns[n].fetchval(sql, *args)
            inside[n].set()
            await release.wait()
        return value

    pg._db.fetchval_grouped = own_transaction  # type: ignore[method-assign]
    try:
        writes = [asyncio.create_task(pg.transition(job.id, Change(expect={"running"}, attempt=1, progress=5)))
                  for job in jobs]
        # Both statements ran to the end inside open transactions: neither blocked.
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in inside)), 10)
        release.set()
        assert [(await w).after.version for w in writes] == [3, 3]
    finally:
        release.set()
        for conn in conns:
            await conn.close()
    await pg.outbox_batch(100)
    assert [e.seq for e in await pg.tenant_events("t1", 0, 100)] == list(range(1, 7))


# How an accept was sent before migration 20: the function's OUT parameters, the row spread out.
_ACCEPT_OF_THEN = ("SELECT (a.job).* FROM herald_accept(" + ", ".join(f"${n}" for n in range(1, 22)) + ") AS a")


async def accept_as_then(conn: asyncpg.Connection, new: NewJob) -> JobRow:
    """A start as a process of the legacy schema's time wrote it: its statement, this code's arguments."""
    job = new.queued_row(time.time())
    event, tail = unnumbered_event(job, "job.queued")
    work_subject, work_msg_id, work_payload = pg_jobs._work_message(job)
    record = await conn.fetchrow(
        _ACCEPT_OF_THEN, new.id, new.tenant, new.kind, new.collection, new.params, new.callback_url,
        job.created_at, float(new.deadline_s), None, None, None, None, None,
        event_subject_head(new.tenant, new.id), bytes(event.data), tail, work_subject, work_msg_id, work_payload,
        None, None)
    assert record is not None
    return JobRow.from_mapping(record)


async def test_events_of_a_database_made_before_are_kept_and_numbering_goes_on(fresh_database: str) -> None:
    """Migration 13 on a database with history: old events keep their seq, new ones follow.

    The database before it is the old chain up to the tenant fair share (``tests/legacy_schema``:
    the functions as they were then, which gave each event its seq as it was written), its
    writes made by this code: two starts (``herald_accept`` takes what it took then; a
    transition's function has changed since)."""
    await legacy_pg(fresh_database, upto="jobs-tenant-fair-share")
    conn = await asyncpg.connect(fresh_database)
    try:
        first = await accept_as_then(conn, new_job())
        second = await accept_as_then(conn, new_job())
        # Numbered as they were written, by the functions of then.
        assert [r["seq"] for r in await conn.fetch("SELECT seq FROM events WHERE tenant = 't1' ORDER BY seq")] == [1, 2]
    finally:
        await conn.close()
    store = new_store(fresh_database)
    await store.open()
    try:
        await store.transition(first.id, CLAIM)
        # The old process's rows (complete payloads) and the new one's, as a sweep takes them.
        rows = await store.outbox_batch(100, stale_after_s=0.0)
        events = [msgspec.json.decode(r.payload, type=JobEvent) for r in rows if r.msg_id.startswith("ev.")]
        assert [(e.seq, e.job_id, e.version) for e in events] == [(1, first.id, 1), (2, second.id, 1), (3, first.id, 2)]
        assert [(e.seq, e.job_id, e.version) for e in await store.tenant_events("t1", 0, 10)] == [
            (1, first.id, 1), (2, second.id, 1), (3, first.id, 2)]
    finally:
        await store.close()


async def test_a_numbering_pass_with_nothing_to_number_writes_nothing(pg: PgJobStore, fresh_database: str) -> None:
    """Passes of one tenant take turns on an advisory lock, not a row lock: a pass that finds
    its events numbered by the pass it waited for gets no transaction id, so its commit
    waits for no WAL flush."""
    await running_job(pg)
    await pg.outbox_batch(100)
    conn = await asyncpg.connect(fresh_database)
    try:
        async with conn.transaction():
            assert await conn.fetchval("SELECT herald_number_events('t1')") == 0
            assert await conn.fetchval("SELECT pg_current_xact_id_if_assigned()") is None
        await running_job(pg)
        async with conn.transaction():
            assert await conn.fetchval("SELECT herald_number_events('t1')") == 2
            assert await conn.fetchval("SELECT pg_current_xact_id_if_assigned()") is not None
        assert [e.seq for e in await pg.tenant_events("t1", 0, 10)] == [1, 2, 3, 4]
        assert await pg.last_event_seq("t1") == 4
    finally:
        await conn.close()
