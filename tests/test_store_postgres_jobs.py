"""The PostgreSQL job store against a real server, with real concurrency.

What a user relies on: one job per Idempotency-Key however many gateways race; a stale
writer never overwrites a newer version; a tenant's event history is gap-free and readable
in order while it grows; one start budget across gateways; retention leaves tombstones;
every time is the database server's. Each test gets a fresh database on the session's
server (``postgres_server`` in conftest); two ``PgJobStore``s on one database stand for
two gateways (two pools).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import msgspec
import pytest
from prometheus_client import REGISTRY

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
from herald.storage.postgres.db import NOW_SQL, PgDatabase
from herald.storage.postgres.jobs import PgJobStore
from herald.storage.postgres.schema import SCHEMA
from herald.storage.ports import OutboxRow, StartBudget
from herald.timefmt import rfc3339
from herald.transitions import Change
from tests.harness import make_sealer
from schemas import JobEvent, JobMessage, Problem

ENCODER = msgspec.json.Encoder()
CLAIM = Change(expect={"queued"}, to="running", claim=True)


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


@pytest.fixture()
async def gateways(fresh_database: str) -> AsyncIterator[tuple[PgJobStore, PgJobStore]]:
    """Two stores on one database, each with its own pool: two gateways."""
    a, b = new_store(fresh_database), new_store(fresh_database)
    await asyncio.gather(a.open(), b.open())
    try:
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())


def new_job(tenant: str = "t1", *, deadline_s: float = 600.0, callback_url: str | None = None) -> NewJob:
    return NewJob(
        id=uuid.uuid4().hex, tenant=tenant, kind="report", collection="/reports",
        params=b'{"title":"t","pages":2}', deadline_s=deadline_s, callback_url=callback_url,
    )


def claim_key(key: str, fingerprint: str = "POST /reports {}") -> IdempotencyClaim:
    return IdempotencyClaim(key=key, fingerprint=fingerprint, ttl_s=3600.0)


async def running_job(pg: PgJobStore, tenant: str = "t1") -> JobRow:
    accepted = await pg.accept(new_job(tenant))
    return (await pg.transition(accepted.job.id, CLAIM)).after


async def db_clock(url: str) -> float:
    conn = await asyncpg.connect(url)
    try:
        return float(await conn.fetchval(f"SELECT {NOW_SQL}"))
    finally:
        await conn.close()


def rejected_total() -> float:
    return REGISTRY.get_sample_value("herald_transitions_rejected_total") or 0.0


async def outcomes(calls: list[Awaitable[Any]]) -> list[Any]:
    """Run the calls at once; results and exceptions side by side."""
    return await asyncio.gather(*calls, return_exceptions=True)


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


# ----- accepting ---------------------------------------------------------------------------


async def test_accept_writes_job_event_and_outbox_rows(pg: PgJobStore) -> None:
    heard: list[tuple[JobRow, JobEvent]] = []
    pg.on_commit(lambda job, event: heard.append((job, event)))

    new = new_job(callback_url="https://example.com/hook")
    accepted = await pg.accept(new)

    job, event = accepted.job, accepted.event
    assert not accepted.replayed and event is not None
    assert (job.id, job.tenant, job.kind, job.collection, job.state) == (new.id, "t1", "report", "/reports", "queued")
    assert (job.version, job.attempt, job.progress, job.cancel_requested) == (1, 0, None, False)
    assert job.params == new.params and job.callback_url == "https://example.com/hook"
    assert job.created_at == job.updated_at and job.deadline_at == pytest.approx(job.created_at + 600.0)
    assert await pg.get(job.id) == job
    assert await pg.get_for_tenant("t1", job.id) == job
    assert await pg.get_for_tenant("other", job.id) is None

    assert (event.seq, event.version, event.type, event.job_id) == (1, 1, "job.queued", job.id)
    assert bytes(event.data) == ENCODER.encode(job.status())
    assert event.at == rfc3339(job.updated_at)
    assert [ENCODER.encode(e) for e in await pg.job_events(job.id, 0)] == [ENCODER.encode(event)]
    assert heard == [(job, event)]

    rows = await pg.outbox_batch(10)
    assert [(r.subject, r.msg_id) for r in rows] == [(f"events.t1.{job.id}", f"ev.{job.id}.1"), ("jobs.report.t1", job.id)]
    assert rows[0].payload == ENCODER.encode(event)  # the exact bytes, seq included
    assert msgspec.msgpack.decode(rows[1].payload, type=JobMessage) == JobMessage(job_id=job.id, kind="report", attempt=0)

    stats = await pg.stats()
    assert stats.outbox_pending == 2 and stats.oldest_queued_age_s >= 0 and stats.outbox_oldest_age_s >= 0
    assert await pg.last_event_seq("t1") == 1 and await pg.last_event_seq("nobody") == 0


async def test_idempotency_key_replays_the_job_or_refuses_another_request(pg: PgJobStore) -> None:
    first = await pg.accept(new_job(), claim_key("k1"))
    again = await pg.accept(new_job(), claim_key("k1"))
    assert again.replayed and again.event is None and again.job == first.job

    with pytest.raises(IdempotencyMismatch):
        await pg.accept(new_job(), claim_key("k1", fingerprint="POST /reports {different}"))

    elsewhere = await pg.accept(new_job("t2"), claim_key("k1"))  # keys are per tenant
    assert not elsewhere.replayed and elsewhere.job.id != first.job.id
    assert [j.id for j in await pg.list_jobs("t1", state=None, kind=None, before=None, limit=10)] == [first.job.id]
    assert len(await pg.outbox_batch(10)) == 4  # two jobs, two rows each: nothing queued twice


async def test_fifty_concurrent_accepts_with_one_key_make_one_job(gateways: tuple[PgJobStore, PgJobStore]) -> None:
    a, b = gateways
    results = await outcomes([(a if i % 2 else b).accept(new_job(), claim_key("same")) for i in range(50)])

    assert all(isinstance(r, Accepted) for r in results), [r for r in results if not isinstance(r, Accepted)]
    assert len({r.job.id for r in results}) == 1
    assert sum(not r.replayed for r in results) == 1
    assert len(await a.list_jobs("t1", state=None, kind=None, before=None, limit=100)) == 1
    assert [e.seq for e in await b.tenant_events("t1", 0, 100)] == [1]


# ----- transitions -------------------------------------------------------------------------


async def test_concurrent_changes_all_apply_in_consecutive_versions(pg: PgJobStore) -> None:
    job = await running_job(pg)
    results = await outcomes(
        [pg.transition(job.id, Change(expect={"running"}, attempt=1, progress=p)) for p in range(1, 21)]
    )

    assert all(isinstance(r, Transition) and r.event is not None for r in results), results
    assert sorted(r.after.version for r in results) == list(range(3, 23))  # no lost update
    assert [e.version for e in await pg.job_events(job.id, 0)] == list(range(1, 23))
    final = await pg.get(job.id)
    assert final is not None and final.version == 22
    assert final.progress == max(results, key=lambda r: r.after.version).after.progress


async def test_conflicting_transitions_have_one_winner_per_expected_state(
    pg: PgJobStore, caplog: pytest.LogCaptureFixture
) -> None:
    job = (await pg.accept(new_job())).job
    rejected_before = rejected_total()
    finishes = [
        Change(expect={"running"}, to="succeeded", attempt=1, result_path="r", media_type="application/pdf"),
        Change(expect={"running"}, to="failed", attempt=1,
               error=Problem(type="/problems/x", title="X", status=500, detail="boom")),
        Change(expect={"running"}, to="cancelled", attempt=1),
    ]

    with caplog.at_level(logging.INFO, logger="herald.store"):
        claims = await outcomes([pg.transition(job.id, CLAIM) for _ in range(20)])
        ends = await outcomes([pg.transition(job.id, finishes[i % 3]) for i in range(20)])

    for round_ in (claims, ends):
        winners = [r for r in round_ if isinstance(r, Transition)]
        assert len(winners) == 1
        assert all(isinstance(r, TransitionRejected) for r in round_ if r is not winners[0])
    assert [e.version for e in await pg.job_events(job.id, 0)] == [1, 2, 3]
    final = await pg.get(job.id)
    assert final is not None and final.terminal and final.expires_at is not None
    assert rejected_total() - rejected_before == 38
    logged = [r for r in caplog.records if r.getMessage() == "transition rejected"]
    assert len(logged) == 38 and all(getattr(r, "job_id", None) == job.id for r in logged)


async def test_fencing_by_attempt(pg: PgJobStore) -> None:
    job = await running_job(pg)
    assert job.attempt == 1 and job.heartbeat_at == job.updated_at

    requeued = await pg.transition(job.id, Change(expect={"running"}, to="queued", attempt=1, requeue=True))
    after = requeued.after
    assert (after.state, after.attempt, after.heartbeat_at, after.progress) == ("queued", 2, None, None)
    assert requeued.event is not None and requeued.event.type == "job.queued"
    work = [r for r in await pg.outbox_batch(100) if r.subject == "jobs.report.t1"]
    assert [r.msg_id for r in work] == [job.id, f"{job.id}.a2"]
    assert msgspec.msgpack.decode(work[-1].payload, type=JobMessage).attempt == 2

    reclaimed = (await pg.transition(job.id, CLAIM)).after
    assert reclaimed.attempt == 2
    with pytest.raises(TransitionRejected) as stale:
        await pg.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1))
    assert stale.value.reason == "attempt is 2, writer has 1" and stale.value.current == reclaimed
    assert await pg.heartbeat(job.id, 1) is None
    assert await pg.get(job.id) == reclaimed


async def test_unknown_job_and_invisible_changes(pg: PgJobStore) -> None:
    with pytest.raises(TransitionRejected) as missing:
        await pg.transition("nope", CLAIM)
    assert missing.value.reason == "no such job" and missing.value.current is None

    job = await running_job(pg)
    same = await pg.transition(job.id, Change(expect={"running"}, attempt=1, progress=None))
    assert same.event is None and same.after == job and (await pg.get(job.id)) == job


async def test_heartbeat_moves_only_its_times(pg: PgJobStore) -> None:
    job = await running_job(pg)
    events_before = await pg.job_events(job.id, 0)
    outbox_before = await pg.outbox_batch(100)

    beat = await pg.heartbeat(job.id, 1)
    assert beat is not None and beat.version == job.version
    assert beat.heartbeat_at == beat.updated_at and beat.updated_at > job.updated_at
    assert len(await pg.job_events(job.id, 0)) == len(events_before)
    assert await pg.outbox_batch(100) == outbox_before

    queued = (await pg.accept(new_job())).job
    assert await pg.heartbeat(queued.id, 0) is None
    assert await pg.heartbeat("nope", 1) is None

    sweep = Change(expect={"running"}, to="queued", attempt=1, requeue=True, stale_before=beat.heartbeat_at)
    with pytest.raises(TransitionRejected, match="heartbeat is fresh"):
        await pg.transition(job.id, sweep)


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


# ----- history -----------------------------------------------------------------------------


async def test_tenant_seq_is_gap_free_and_read_in_order_while_it_grows(
    gateways: tuple[PgJobStore, PgJobStore],
) -> None:
    a, b = gateways
    done = asyncio.Event()
    read: list[int] = []

    async def writer(pg: PgJobStore, tenant: str, jobs: int) -> None:
        for _ in range(jobs):
            job = await running_job(pg, tenant)
            await pg.transition(job.id, Change(expect={"running"}, attempt=1, progress=50))

    async def reader() -> None:
        # A reader that polls after its last seq must never see a hole: seq n+1 visible before n
        # would make it skip n for ever.
        while True:
            finished = done.is_set()
            batch = [e.seq for e in await b.tenant_events("t1", read[-1] if read else 0, 1000)]
            assert batch == list(range(len(read) + 1, len(read) + 1 + len(batch))), (read[-3:], batch[:5])
            read.extend(batch)
            if finished:
                return
            await asyncio.sleep(0.001)

    reading = asyncio.create_task(reader())
    await asyncio.gather(*(writer(a if i % 2 else b, "t1", 8) for i in range(4)), writer(a, "t2", 5))
    done.set()
    await reading

    assert read == list(range(1, 4 * 8 * 3 + 1))
    assert await a.last_event_seq("t1") == 96
    assert [e.seq for e in await a.tenant_events("t2", 0, 1000)] == list(range(1, 16))
    assert [e.seq for e in await a.tenant_events("t1", 90, 1000, kind="report")] == list(range(91, 97))
    assert await a.tenant_events("t1", 0, 10, kind="export") == []
    # The outbox announces a tenant's events in the same order.
    announced = [msgspec.json.decode(r.payload, type=JobEvent) for r in await a.outbox_batch(1000, stale_after_s=0)
                 if r.subject.startswith("events.t1.")]
    assert [e.seq for e in announced] == list(range(1, 97))


# ----- start budget ------------------------------------------------------------------------


async def test_one_start_budget_across_two_gateways(gateways: tuple[PgJobStore, PgJobStore]) -> None:
    a, b = gateways
    budget = StartBudget(rate=0.5, burst=5)
    started = time.monotonic()
    results = await outcomes([(a if i % 2 else b).accept(new_job(), budget=budget) for i in range(20)])
    elapsed = time.monotonic() - started

    admitted = [r for r in results if isinstance(r, Accepted)]
    limited = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) + len(limited) == 20, results
    assert 5 <= len(admitted) <= 5 + int(elapsed * budget.rate) + 1
    assert all(0 < r.wait_s <= 1 / budget.rate and r.tenant == "t1" for r in limited)
    # A refused start wrote nothing.
    assert len(await a.list_jobs("t1", state=None, kind=None, before=None, limit=100)) == len(admitted)
    assert len(await b.outbox_batch(1000, stale_after_s=0)) == 2 * len(admitted)


async def test_replays_spend_the_budget_and_mismatches_do_not(pg: PgJobStore) -> None:
    budget = StartBudget(rate=0.001, burst=2)
    await pg.accept(new_job(), claim_key("k"), budget)  # 1 left
    with pytest.raises(IdempotencyMismatch):
        await pg.accept(new_job(), claim_key("k", "other request"), budget)  # still 1 left
    assert (await pg.accept(new_job(), claim_key("k"), budget)).replayed  # 0 left
    with pytest.raises(RateLimited) as caught:
        await pg.accept(new_job(), claim_key("k"), budget)
    assert caught.value.wait_s > 0
    unlimited = await pg.accept(new_job())  # no budget given: no limit
    assert not unlimited.replayed


# ----- outbox, sweeping, retention --------------------------------------------------------


async def test_each_process_publishes_its_own_rows_and_anyone_those_left_behind(
    gateways: tuple[PgJobStore, PgJobStore],
) -> None:
    a, b = gateways
    from_a = [(await a.accept(new_job())).job.id for _ in range(2)]
    from_b = [(await b.accept(new_job())).job.id for _ in range(3)]

    def jobs_of(rows: list[OutboxRow]) -> set[str]:
        return {r.msg_id.split(".")[1] if r.msg_id.startswith("ev.") else r.msg_id for r in rows}

    assert jobs_of(await a.outbox_batch(100)) == set(from_a)  # a's relay, woken by a's commits
    assert jobs_of(await b.outbox_batch(100)) == set(from_b)
    assert await a.outbox_batch(100, stale_after_s=60) == []  # nothing is left behind yet...
    # ...but b's rows, b gone, are any relay's after a while (the store's clock).
    await b.close()
    stale = await a.outbox_batch(100, stale_after_s=0)
    assert jobs_of(stale) == set(from_a) | set(from_b) and [r.seq for r in stale] == sorted(r.seq for r in stale)


async def test_outbox_batch_and_done(pg: PgJobStore) -> None:
    for _ in range(3):
        await pg.accept(new_job())
    first = await pg.outbox_batch(4)
    assert len(first) == 4 and [r.seq for r in first] == sorted(r.seq for r in first)
    await pg.outbox_done([r.seq for r in first])
    rest = await pg.outbox_batch(10)
    assert len(rest) == 2 and rest[0].seq > first[-1].seq
    await pg.outbox_done([])
    assert (await pg.stats()).outbox_pending == 2
    await pg.outbox_done([r.seq for r in rest])
    stats = await pg.stats()
    assert (stats.outbox_pending, stats.outbox_oldest_age_s) == (0, 0.0)


async def test_live_jobs_for_the_sweeper(pg: PgJobStore) -> None:
    late = (await pg.accept(new_job(deadline_s=0.0))).job
    running = await running_job(pg)
    fresh = (await pg.accept(new_job())).job
    now = await pg.clock()

    stale = {j.id for j in await pg.live_jobs(stale_before=now + 1, deadline_before=now)}
    assert stale == {late.id, running.id}
    assert fresh.id not in stale
    assert {j.id for j in await pg.live_jobs(stale_before=0, deadline_before=now)} == {late.id}


async def test_retention_forgets_jobs_and_leaves_tombstones(fresh_database: str) -> None:
    pg = new_store(fresh_database, retention_s=0.0)
    await pg.open()
    try:
        key = claim_key("kept")
        job = (await pg.accept(new_job(), key)).job
        await pg.transition(job.id, CLAIM)
        done = (await pg.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1,
                                                      result_path="results/x.pdf", media_type="application/pdf"))).after
        assert (done.progress, done.result_path, done.media_type) == (100, "results/x.pdf", "application/pdf")
        assert done.expires_at == done.finished_at == done.updated_at
        other = (await pg.accept(new_job())).job  # alive: not expired

        at = await pg.clock()
        expired = await pg.expired(at)
        assert [j.id for j in expired] == [job.id]
        await pg.forget(expired + expired, at)  # listed twice: still one tombstone

        assert await pg.get(job.id) is None
        assert await pg.tombstone_tenant(job.id) == "t1"
        assert await pg.tombstone_tenant(other.id) is None
        assert await pg.job_events(job.id, 0) == []
        assert await pg.get(other.id) == other
        again = await pg.accept(new_job(), key)  # the key went with the job
        assert not again.replayed and again.job.id != job.id
    finally:
        await pg.close()


async def test_two_gateways_forget_the_same_jobs_at_once(fresh_database: str) -> None:
    a, b = new_store(fresh_database, retention_s=0.0), new_store(fresh_database, retention_s=0.0)
    await asyncio.gather(a.open(), b.open())
    try:
        ids = []
        for i in range(30):
            job = (await a.accept(new_job(), claim_key(f"k{i}"))).job
            await a.transition(job.id, Change(expect={"queued"}, to="cancelled"))
            ids.append(job.id)
        at = await a.clock()
        doomed = await a.expired(at)
        assert sorted(j.id for j in doomed) == sorted(ids)

        # Each sweep forgets what the other is not forgetting at that moment; neither waits.
        results = await outcomes([sweeper.forget(doomed, at) for sweeper in (a, b, a, b)])
        assert results == [None] * 4

        assert await a.expired(await a.clock()) == []
        assert [await b.tombstone_tenant(i) for i in ids] == ["t1"] * 30
        assert [await b.get(i) for i in ids] == [None] * 30
        assert not (await a.accept(new_job(), claim_key("k7"))).replayed  # keys went with their jobs
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_list_jobs_newest_first_with_filters_and_cursor(pg: PgJobStore) -> None:
    ids = [(await pg.accept(new_job())).job.id for _ in range(5)]
    await pg.transition(ids[1], Change(expect={"queued"}, to="cancelled"))

    page = await pg.list_jobs("t1", state=None, kind=None, before=None, limit=3)
    assert [j.id for j in page] == ids[::-1][:3]
    cursor = (page[-1].created_at, page[-1].id)
    assert [j.id for j in await pg.list_jobs("t1", state=None, kind=None, before=cursor, limit=3)] == ids[1::-1]
    assert [j.id for j in await pg.list_jobs("t1", state="cancelled", kind="report", before=None, limit=9)] == [ids[1]]
    assert await pg.list_jobs("t1", state=None, kind="export", before=None, limit=9) == []


# ----- shared secrets, schema, clock -------------------------------------------------------


async def test_signing_key_is_the_same_for_every_process(gateways: tuple[PgJobStore, PgJobStore]) -> None:
    a, b = gateways
    keys = await asyncio.gather(*((a if i % 2 else b).signing_key() for i in range(10)))
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert await a.signing_key() == keys[0]


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


async def test_a_capped_claim_never_takes_the_tenants_last_slot_twice(gateways: tuple[PgJobStore, PgJobStore]) -> None:
    """SPEC §13 max_running: ten claims of one tenant's jobs at once, from two processes, with
    a cap of 2: exactly two run, the rest stay queued (TENANT_AT_CAP); another tenant's claim
    is not held back; once one ends, the next claim succeeds."""
    from herald.transitions import TENANT_AT_CAP

    a, b = gateways
    jobs = [(await a.accept(new_job("capped"))).job.id for _ in range(10)]
    capped = Change(expect={"queued"}, to="running", claim=True, max_running=2)
    outcomes = await asyncio.gather(*((a if n % 2 else b).transition(job_id, capped) for n, job_id in enumerate(jobs)),
                                    return_exceptions=True)
    won = [o.after.id for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(won) == 2 and all(isinstance(o, TransitionRejected) and o.reason == TENANT_AT_CAP for o in refused)
    assert (await a.running_counts(["capped", "nobody"])) == {"capped": 2, "nobody": 0}
    assert [(await a.get(job_id)).state for job_id in jobs].count("queued") == 8  # type: ignore[union-attr]

    other = (await a.accept(new_job("other"))).job.id
    assert (await b.transition(other, capped)).after.state == "running"

    await a.transition(won[0], Change(expect={"running"}, to="succeeded", attempt=1))
    waiting = next(job_id for job_id in jobs if job_id not in won)
    assert (await b.transition(waiting, capped)).after.state == "running"


async def test_a_tenants_own_queue_age(pg: PgJobStore) -> None:
    """The backlog guard's read: the age of one tenant's oldest queued job of a kind."""
    await pg.accept(new_job("slow"))
    assert await pg.tenant_queued_age("report", "slow") >= 0.0
    assert await pg.tenant_queued_age("report", "idle") == 0.0
    assert await pg.tenant_queued_age("export", "slow") == 0.0


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
