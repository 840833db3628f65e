"""The job store's contract (``herald.storage.ports.JobStore``), on every backend.

What a user relies on: one job per Idempotency-Key however many gateways race; a stale
writer never overwrites a newer version; a tenant's event history is gap-free and readable
in order while it grows; one start budget across gateways; retention leaves tombstones.
"Two gateways" are two processes' stores on one database (``Stores.another``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import msgspec
import pytest
from prometheus_client import REGISTRY

from herald import workmessage
from herald.jobs import (
    Accepted,
    IdempotencyMismatch,
    JobRow,
    RateLimited,
    Transition,
    TransitionRejected,
)
from herald.storage.ports import JobStore, OutboxRow, StartBudget
from herald.timefmt import rfc3339
from herald.transitions import TENANT_AT_CAP, Change
from schemas import JobEvent, Problem
from tests.store_contract.conftest import Stores
from tests.store_contract.support import CLAIM, claim_key, new_job, outcomes, relay_pass, running_job

ENCODER = msgspec.json.Encoder()


def rejected_total() -> float:
    return REGISTRY.get_sample_value("herald_transitions_rejected_total") or 0.0


def jobs_of(rows: list[OutboxRow]) -> set[str]:
    return {r.msg_id.split(".")[1] if r.msg_id.startswith("ev.") else r.msg_id for r in rows}


# ----- accepting ---------------------------------------------------------------------------


async def test_accept_writes_job_event_and_outbox_rows(stores: Stores) -> None:
    store = stores.jobs
    heard: list[tuple[JobRow, JobEvent]] = []
    store.on_commit(lambda job, event: heard.append((job, event)))

    new = new_job(callback_url="https://example.com/hook")
    accepted = await store.accept(new)

    job, event = accepted.job, accepted.event
    assert not accepted.replayed and event is not None
    assert (job.id, job.tenant, job.kind, job.collection, job.state) == (new.id, "t1", "report", "/reports", "queued")
    assert (job.version, job.attempt, job.progress, job.cancel_requested) == (1, 0, None, False)
    assert job.params == new.params and job.callback_url == "https://example.com/hook"
    assert job.created_at == job.updated_at and job.deadline_at == pytest.approx(job.created_at + 600.0)
    assert await store.get(job.id) == job
    assert await store.get_for_tenant("t1", job.id) == job
    assert await store.get_for_tenant("other", job.id) is None

    # Its seq: 1 if the backend numbers events as they commit (SQLite), 0 if after commit,
    # in the relay's batch (PostgreSQL; ports.py, "Ordered history").
    assert (event.seq, event.version, event.type, event.job_id) in {(n, 1, "job.queued", job.id) for n in (0, 1)}
    assert bytes(event.data) == ENCODER.encode(job.status())
    assert event.at == rfc3339(job.updated_at)
    assert [ENCODER.encode(e) for e in await store.job_events(job.id, 0)] == [ENCODER.encode(event)]
    assert heard == [(job, event)]
    # The feed has every committed event, numbered (a backend numbering after commit numbers
    # the tenant's committed events before it reads).
    assert [(e.seq, e.job_id, e.version) for e in await store.tenant_events("t1", 0, 10)] == [(1, job.id, 1)]

    rows = await store.outbox_batch(10)
    # ".notify": the job's callback URL wants its queued event (the next test: an event's audience).
    assert [(r.subject, r.msg_id) for r in rows] == [(f"events.t1.{job.id}.notify", f"ev.{job.id}.1"),
                                                     ("jobs.report.t1", job.id)]
    numbered = msgspec.structs.replace(event, seq=1)
    assert rows[0].payload == ENCODER.encode(numbered)  # the exact bytes, seq included
    work = workmessage.decode(rows[1].payload)
    assert (work.job_id, work.kind, work.attempt) == (job.id, "report", 0)
    # The job's row as queued, where the store's worker claims on it (PostgreSQL): all of it
    # but the callback_url, which no worker needs and a message should not spread.
    carried = workmessage.carried_row(work)
    assert carried is None or carried == dataclasses.replace(job, callback_url=None)
    assert await store.tenant_events("t1", 0, 10) == await store.job_events(job.id, 0) == [numbered]

    stats = await store.stats()
    assert stats.outbox_pending == 2 and stats.oldest_queued_age_s >= 0 and stats.outbox_oldest_age_s >= 0
    assert await store.last_event_seq("t1") == 1 and await store.last_event_seq("nobody") == 0



async def test_an_events_subject_says_whether_some_webhook_target_wanted_it_as_it_committed(stores: Stores) -> None:
    # The notifier's consumer takes only "notify" events: a "quiet" one no endpoint or callback
    # wanted must be exactly that, or a delivery would be lost.
    store = stores.jobs

    async def audiences(job_id: str) -> list[tuple[str, str]]:
        rows = [r for r in await relay_pass(store) if r.subject.startswith("events.")]
        assert {r.subject.split(".")[2] for r in rows} == {job_id}
        return [(r.msg_id.rsplit(".", 1)[1], r.subject.rsplit(".", 1)[1]) for r in rows]

    plain = await running_job(store)
    await store.transition(plain.id, Change(expect={"running"}, attempt=1, progress=50))
    await store.transition(plain.id, Change(expect={"running"}, attempt=1, to="succeeded"))
    assert await audiences(plain.id) == [("1", "quiet"), ("2", "quiet"), ("3", "quiet"), ("4", "quiet")]

    # An endpoint of the tenant for the outcome of reports: only that event notifies. Another
    # tenant's endpoint, a disabled one and one for another kind change nothing.
    await stores.webhooks.create_endpoint("t2", url="https://a.example/hook", event_types=["job.queued"],
                                          kinds=None, signature="hmac-sha256")
    await stores.webhooks.create_endpoint("t1", url="https://b.example/hook", event_types=["job.running"],
                                          kinds=["export"], signature="hmac-sha256")
    off, _ = await stores.webhooks.create_endpoint("t1", url="https://c.example/hook", event_types=["job.queued"],
                                                   kinds=None, signature="hmac-sha256")
    await stores.webhooks.update_endpoint("t1", off.id, {"status": "disabled"})
    await stores.webhooks.create_endpoint("t1", url="https://d.example/hook", event_types=["job.succeeded"],
                                          kinds=["report"], signature="hmac-sha256")
    watched = await running_job(store)
    await store.transition(watched.id, Change(expect={"running"}, attempt=1, progress=50))
    await store.transition(watched.id, Change(expect={"running"}, attempt=1, to="succeeded"))
    assert await audiences(watched.id) == [("1", "quiet"), ("2", "quiet"), ("3", "quiet"), ("4", "notify")]

    # A callback URL wants every event of its job but progress.
    called = await store.accept(new_job(callback_url="https://e.example/cb"))
    await store.transition(called.job.id, CLAIM)
    await store.transition(called.job.id, Change(expect={"running"}, attempt=1, progress=50))
    await store.transition(called.job.id, Change(expect={"running"}, attempt=1, to="failed",
                                                 error=Problem(type="about:blank", title="no", status=500)))
    assert await audiences(called.job.id) == [("1", "notify"), ("2", "notify"), ("3", "quiet"), ("4", "notify")]

async def test_an_accepted_job_is_the_row_another_process_reads(stores: Stores) -> None:
    accepted = await stores.jobs.accept(new_job(callback_url="https://example.com/hook"))
    assert await (await stores.another()).jobs.get(accepted.job.id) == accepted.job


async def test_idempotency_key_replays_the_job_or_refuses_another_request(stores: Stores) -> None:
    store = stores.jobs
    first = await store.accept(new_job(), claim_key("k1"))
    again = await store.accept(new_job(), claim_key("k1"))
    assert again.replayed and again.event is None and again.job == first.job

    with pytest.raises(IdempotencyMismatch):
        await store.accept(new_job(), claim_key("k1", fingerprint="POST /reports {different}"))

    elsewhere = await store.accept(new_job("t2"), claim_key("k1"))  # keys are per tenant
    assert not elsewhere.replayed and elsewhere.job.id != first.job.id
    assert [j.id for j in await store.list_jobs("t1", state=None, kind=None, before=None, limit=10)] == [first.job.id]
    assert len(await store.outbox_batch(10)) == 4  # two jobs, two rows each: nothing queued twice


async def test_find_replay_reads_what_accept_would_replay_and_writes_nothing(stores: Stores) -> None:
    """For a start refused before the store (back-pressure), which still answers a replay."""
    store, other = stores.jobs, (await stores.another()).jobs
    assert await store.find_replay("t1", claim_key("k1")) is None  # never used
    first = await store.accept(new_job(), claim_key("k1"))
    outbox = len(await store.outbox_batch(10))
    for reader in (store, other):
        assert await reader.find_replay("t1", claim_key("k1")) == first.job
        with pytest.raises(IdempotencyMismatch):
            await reader.find_replay("t1", claim_key("k1", fingerprint="POST /reports {different}"))
        assert await reader.find_replay("t2", claim_key("k1")) is None  # keys are per tenant
    assert [j.id for j in await store.list_jobs("t1", state=None, kind=None, before=None, limit=10)] == [first.job.id]
    assert len(await store.outbox_batch(10)) == outbox
    # A key past its life is no replay, as accept starts a new job for it.
    short = dataclasses.replace(claim_key("k2"), ttl_s=0.2)
    await store.accept(new_job(), short)
    assert await store.find_replay("t1", short) is not None
    await asyncio.sleep(0.4)
    assert await store.find_replay("t1", short) is None
    assert not (await store.accept(new_job(), short)).replayed


async def test_fifty_concurrent_accepts_with_one_key_make_one_job(stores: Stores) -> None:
    """ports.py, "Idempotency converges": never a unique-violation error, one job."""
    a, b = stores.jobs, (await stores.another()).jobs
    results = await outcomes([(a if i % 2 else b).accept(new_job(), claim_key("same")) for i in range(50)])

    assert all(isinstance(r, Accepted) for r in results), [r for r in results if not isinstance(r, Accepted)]
    assert len({r.job.id for r in results}) == 1
    assert sum(not r.replayed for r in results) == 1
    assert len(await a.list_jobs("t1", state=None, kind=None, before=None, limit=100)) == 1
    await relay_pass(b, everyone=True)
    assert [e.seq for e in await b.tenant_events("t1", 0, 100)] == [1]


# ----- transitions -------------------------------------------------------------------------


async def test_concurrent_changes_all_apply_in_consecutive_versions(stores: Stores) -> None:
    store = stores.jobs
    job = await running_job(store)
    results = await outcomes(
        [store.transition(job.id, Change(expect={"running"}, attempt=1, progress=p)) for p in range(1, 21)]
    )

    assert all(isinstance(r, Transition) and r.event is not None for r in results), results
    assert sorted(r.after.version for r in results) == list(range(3, 23))  # no lost update
    assert [e.version for e in await store.job_events(job.id, 0)] == list(range(1, 23))
    final = await store.get(job.id)
    assert final is not None and final.version == 22
    assert final.progress == max(results, key=lambda r: r.after.version).after.progress


async def test_conflicting_transitions_have_one_winner_per_expected_state(
    stores: Stores, caplog: pytest.LogCaptureFixture
) -> None:
    """ports.py, "Compare-and-set transitions": one writer per expected state wins, the rest are refused."""
    store = stores.jobs
    job = (await store.accept(new_job())).job
    rejected_before = rejected_total()
    finishes = [
        Change(expect={"running"}, to="succeeded", attempt=1, result_path="r", media_type="application/pdf"),
        Change(expect={"running"}, to="failed", attempt=1,
               error=Problem(type="/problems/x", title="X", status=500, detail="boom")),
        Change(expect={"running"}, to="cancelled", attempt=1),
    ]

    with caplog.at_level(logging.INFO, logger="herald.store"):
        claims = await outcomes([store.transition(job.id, CLAIM) for _ in range(20)])
        ends = await outcomes([store.transition(job.id, finishes[i % 3]) for i in range(20)])

    for round_ in (claims, ends):
        winners = [r for r in round_ if isinstance(r, Transition)]
        assert len(winners) == 1
        assert all(isinstance(r, TransitionRejected) for r in round_ if r is not winners[0])
    assert [e.version for e in await store.job_events(job.id, 0)] == [1, 2, 3]
    final = await store.get(job.id)
    assert final is not None and final.terminal and final.expires_at is not None
    assert rejected_total() - rejected_before == 38
    logged = [r for r in caplog.records if r.getMessage() == "transition rejected"]
    assert len(logged) == 38 and all(getattr(r, "job_id", None) == job.id for r in logged)


async def test_fencing_by_attempt(stores: Stores) -> None:
    store = stores.jobs
    job = await running_job(store)
    assert job.attempt == 1 and job.heartbeat_at == job.updated_at

    requeued = await store.transition(job.id, Change(expect={"running"}, to="queued", attempt=1, requeue=True))
    after = requeued.after
    assert (after.state, after.attempt, after.heartbeat_at, after.progress) == ("queued", 2, None, None)
    assert requeued.event is not None and requeued.event.type == "job.queued"
    work = [r for r in await store.outbox_batch(100) if r.subject == "jobs.report.t1"]
    assert [r.msg_id for r in work] == [job.id, f"{job.id}.a2"]
    requeue_message = workmessage.decode(work[-1].payload)
    assert requeue_message.attempt == 2
    assert workmessage.carried_row(requeue_message) in (None, dataclasses.replace(after, callback_url=None))

    reclaimed = (await store.transition(job.id, CLAIM)).after
    assert reclaimed.attempt == 2
    with pytest.raises(TransitionRejected) as stale:
        await store.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1))
    assert stale.value.reason == "attempt is 2, writer has 1" and stale.value.current == reclaimed
    assert await store.heartbeat(job.id, 1) is None
    assert await store.get(job.id) == reclaimed


async def test_a_success_keeps_its_small_result_in_the_row(stores: Stores) -> None:
    """``keeps_results``: the success's own write keeps the result body in the row, which
    every process reads back with the job; a requeued attempt's row has none."""
    store = stores.jobs
    assert store.keeps_results
    job = await running_job(store)
    body = ENCODER.encode({"answer": 42, "text": "x" * 1000})
    done = await store.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1, result_body=body,
                                                 media_type="application/json"))
    after = done.after
    assert (after.state, after.result_body, after.media_type, after.result_path) == (
        "succeeded", body, "application/json", None)
    other = await stores.another()
    assert await other.jobs.get(job.id) == await store.get(job.id) == after
    assert done.event is not None and b"answer" not in bytes(done.event.data)  # the status links to it
    plain = await running_job(store)
    assert (await store.get(plain.id)) == plain and plain.result_body is None


async def test_unknown_job_and_invisible_changes(stores: Stores) -> None:
    store = stores.jobs
    with pytest.raises(TransitionRejected) as missing:
        await store.transition("nope", CLAIM)
    assert missing.value.reason == "no such job" and missing.value.current is None

    job = await running_job(store)
    same = await store.transition(job.id, Change(expect={"running"}, attempt=1, progress=None))
    assert same.event is None and same.after == job and (await store.get(job.id)) == job


async def test_a_remembered_row_that_moved_is_read_and_judged_again(stores: Stores) -> None:
    """ports.py ``remember``: a process may judge a job's next change on the row it saw last
    (a worker's claim on the row it was handed, its success on its claim). When another
    process moved the job since (a claim, a cancel request, a heartbeat, a requeue), the
    change is judged on the row as it is: never refused on the remembered row, never
    written over the other's change."""
    mine, other = stores.jobs, (await stores.another()).jobs
    queued = (await mine.accept(new_job())).job
    mine.remember(queued)
    claimed = await other.transition(queued.id, CLAIM)
    with pytest.raises(TransitionRejected, match="state is running") as refused:
        await mine.transition(queued.id, CLAIM)
    assert refused.value.current == claimed.after

    job = await running_job(mine)  # this process saw it last: running, version 2
    await other.transition(job.id, Change(expect={"running"}, attempt=1, cancel_requested=True))
    done = await mine.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1))
    assert (done.before.version, done.after.version, done.after.cancel_requested) == (3, 4, True)
    assert [e.version for e in await mine.job_events(job.id, 0)] == [1, 2, 3, 4]

    beating = await running_job(mine)
    beat = await other.heartbeat(beating.id, 1)  # moves updated_at and heartbeat_at, not the version
    assert beat is not None and beat.version == beating.version
    moved = await mine.transition(beating.id, Change(expect={"running"}, attempt=1, progress=10))
    assert moved.before == beat and moved.after.heartbeat_at == beat.heartbeat_at
    assert await mine.get(beating.id) == moved.after

    # Refused on the remembered row (attempt 1), allowed on the row as it is (attempt 2).
    third = await running_job(mine)
    await other.transition(third.id, Change(expect={"running"}, to="queued", attempt=1, requeue=True))
    again = (await other.transition(third.id, CLAIM)).after
    progressed = await mine.transition(third.id, Change(expect={"running"}, attempt=2, progress=10))
    assert (progressed.before, progressed.after.progress, progressed.after.version) == (again, 10, 5)


async def test_heartbeat_moves_only_its_times(stores: Stores) -> None:
    store = stores.jobs
    job = await running_job(store)
    events_before = await store.job_events(job.id, 0)
    outbox_before = await store.outbox_batch(100)

    beat = await store.heartbeat(job.id, 1)
    assert beat is not None and beat.version == job.version
    assert beat.heartbeat_at == beat.updated_at and beat.updated_at > job.updated_at
    assert len(await store.job_events(job.id, 0)) == len(events_before)
    assert await store.outbox_batch(100) == outbox_before

    queued = (await store.accept(new_job())).job
    assert await store.heartbeat(queued.id, 0) is None
    assert await store.heartbeat("nope", 1) is None

    sweep = Change(expect={"running"}, to="queued", attempt=1, requeue=True, stale_before=beat.heartbeat_at)
    with pytest.raises(TransitionRejected, match="heartbeat is fresh"):
        await store.transition(job.id, sweep)


async def test_a_capped_claim_never_takes_the_tenants_last_slot_twice(stores: Stores) -> None:
    """ports.py, "A capped claim counts under a lock" (SPEC §13 max_running): ten claims of one
    tenant's jobs at once, from two processes, with a cap of 2: exactly two run, the rest stay
    queued (TENANT_AT_CAP); another tenant's claim is not held back; once one ends, the next
    claim succeeds."""
    a, b = stores.jobs, (await stores.another()).jobs
    jobs = [(await a.accept(new_job("capped"))).job.id for _ in range(10)]
    capped = Change(expect={"queued"}, to="running", claim=True, max_running=2)
    results = await outcomes([(a if n % 2 else b).transition(job_id, capped) for n, job_id in enumerate(jobs)])
    won = [o.after.id for o in results if not isinstance(o, BaseException)]
    refused = [o for o in results if isinstance(o, BaseException)]
    assert len(won) == 2 and all(isinstance(o, TransitionRejected) and o.reason == TENANT_AT_CAP for o in refused)
    assert (await a.running_counts(["capped", "nobody"])) == {"capped": 2, "nobody": 0}
    assert await b.running_counts(["capped"]) == {"capped": 2}
    assert await a.tenant_queued_age("report", "capped") >= 0.0 and await a.tenant_queued_age("report", "x") == 0.0
    assert [(await a.get(job_id)).state for job_id in jobs].count("queued") == 8  # type: ignore[union-attr]

    other = (await a.accept(new_job("other"))).job.id
    assert (await b.transition(other, capped)).after.state == "running"

    await a.transition(won[0], Change(expect={"running"}, to="succeeded", attempt=1))
    waiting = next(job_id for job_id in jobs if job_id not in won)
    assert (await b.transition(waiting, capped)).after.state == "running"


# ----- history -----------------------------------------------------------------------------


async def test_tenant_seq_is_gap_free_and_read_in_order_while_it_grows(stores: Stores) -> None:
    """ports.py, "Ordered history", with two processes writing (each with its relay's passes
    numbering and taking its own rows, as every committing process runs one) and a third
    process reading: a reader that polls after its last seq never sees a hole (seq n+1
    readable before n would make it skip n for ever), nor an event twice, and reads each
    job's events in version order; what the relays announce is what the reader reads."""
    a, b, c = stores.jobs, (await stores.another()).jobs, (await stores.another()).jobs
    written, relayed = asyncio.Event(), asyncio.Event()
    read: list[JobEvent] = []
    announced: list[JobEvent] = []

    async def writer(store: JobStore, tenant: str, jobs: int) -> None:
        for _ in range(jobs):
            job = await running_job(store, tenant)
            await store.transition(job.id, Change(expect={"running"}, attempt=1, progress=50))

    async def relay(store: JobStore) -> None:
        while True:
            finished = written.is_set()
            rows = await relay_pass(store)
            announced.extend(msgspec.json.decode(r.payload, type=JobEvent) for r in rows
                             if r.subject.startswith("events."))
            if finished and not rows:
                return
            await asyncio.sleep(0.001)

    async def reader() -> None:
        while True:
            finished = relayed.is_set()
            batch = await c.tenant_events("t1", read[-1].seq if read else 0, 1000)
            seqs = [e.seq for e in batch]
            assert seqs == list(range(len(read) + 1, len(read) + 1 + len(batch))), (read[-3:], seqs[:5])
            read.extend(batch)
            if finished:
                return
            await asyncio.sleep(0.001)

    reading = asyncio.create_task(reader())
    relays = [asyncio.create_task(relay(store)) for store in (a, b)]
    await asyncio.gather(*(writer(a if i % 2 else b, "t1", 8) for i in range(4)), writer(a, "t2", 5))
    written.set()
    await asyncio.gather(*relays)
    relayed.set()
    await reading

    assert [e.seq for e in read] == list(range(1, 4 * 8 * 3 + 1))
    by_job: dict[str, list[int]] = {}
    for e in read:
        by_job.setdefault(e.job_id, []).append(e.version)
    assert len(by_job) == 32 and all(versions == [1, 2, 3] for versions in by_job.values()), by_job
    assert await a.last_event_seq("t1") == 96
    assert [e.seq for e in await a.tenant_events("t2", 0, 1000)] == list(range(1, 16))
    assert [e.seq for e in await a.tenant_events("t1", 90, 1000, kind="report")] == list(range(91, 97))
    assert await a.tenant_events("t1", 0, 10, kind="export") == []
    # The relays announced every event once, numbered as the reader read it.
    assert sorted((ENCODER.encode(e) for e in announced if e.tenant == "t1")) == sorted(ENCODER.encode(e) for e in read)


# ----- start budget ------------------------------------------------------------------------


async def test_one_start_budget_across_two_gateways(stores: Stores) -> None:
    """ports.py, "One rate budget": every gateway draws on one bucket; a refused start writes nothing."""
    a, b = stores.jobs, (await stores.another()).jobs
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


async def test_replays_spend_the_budget_and_mismatches_do_not(stores: Stores) -> None:
    store = stores.jobs
    budget = StartBudget(rate=0.001, burst=2)
    await store.accept(new_job(), claim_key("k"), budget)  # 1 left
    with pytest.raises(IdempotencyMismatch):
        await store.accept(new_job(), claim_key("k", "other request"), budget)  # still 1 left
    assert (await store.accept(new_job(), claim_key("k"), budget)).replayed  # 0 left
    with pytest.raises(RateLimited) as caught:
        await store.accept(new_job(), claim_key("k"), budget)
    assert caught.value.wait_s > 0
    unlimited = await store.accept(new_job())  # no budget given: no limit
    assert not unlimited.replayed


# ----- outbox, sweeping, retention --------------------------------------------------------


async def test_each_process_publishes_its_own_rows_and_anyone_those_left_behind(stores: Stores) -> None:
    other = await stores.another()
    a, b = stores.jobs, other.jobs
    from_a = [(await a.accept(new_job())).job.id for _ in range(2)]
    from_b = [(await b.accept(new_job())).job.id for _ in range(3)]

    assert jobs_of(await a.outbox_batch(100)) == set(from_a)  # a's relay, woken by a's commits
    assert jobs_of(await b.outbox_batch(100)) == set(from_b)
    assert await a.outbox_batch(100, stale_after_s=60) == []  # nothing is left behind yet...
    # ...but b's rows, b gone, are any relay's after a while (the store's clock).
    await b.close()
    stale = await a.outbox_batch(100, stale_after_s=0)
    assert jobs_of(stale) == set(from_a) | set(from_b) and [r.seq for r in stale] == sorted(r.seq for r in stale)
    await a.outbox_done([r.seq for r in stale])
    assert await a.outbox_batch(100, stale_after_s=0) == []


async def test_outbox_batch_and_done(stores: Stores) -> None:
    store = stores.jobs
    for _ in range(3):
        await store.accept(new_job())
    first = await store.outbox_batch(4)
    assert len(first) == 4 and [r.seq for r in first] == sorted(r.seq for r in first)
    await store.outbox_done([r.seq for r in first])
    rest = await store.outbox_batch(10)
    assert len(rest) == 2 and rest[0].seq > first[-1].seq
    await store.outbox_done([])
    assert (await store.stats()).outbox_pending == 2
    await store.outbox_done([r.seq for r in rest])
    stats = await store.stats()
    assert (stats.outbox_pending, stats.outbox_oldest_age_s) == (0, 0.0)


async def test_live_jobs_for_the_sweeper(stores: Stores) -> None:
    store = stores.jobs
    late = (await store.accept(new_job(deadline_s=0.0))).job
    running = await running_job(store)
    fresh = (await store.accept(new_job())).job
    now = await store.clock()

    stale = {j.id for j in await store.live_jobs(stale_before=now + 1, deadline_before=now)}
    assert stale == {late.id, running.id}
    assert fresh.id not in stale
    assert {j.id for j in await store.live_jobs(stale_before=0, deadline_before=now)} == {late.id}


# PostgreSQL stamps a transition with the server's time guessed from a recent clock read
# (herald/storage/postgres/recent.py: off by up to half that read's round trip, either way),
# so a clock read just after it may be a little behind its stamp on a loaded machine.
STAMP_SLACK_S = 1.0

async def test_retention_forgets_jobs_and_leaves_tombstones(stores: Stores) -> None:
    store = (await stores.another(retention_s=0.0)).jobs
    key = claim_key("kept")
    job = (await store.accept(new_job(), key)).job
    await store.transition(job.id, CLAIM)
    done = (await store.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1,
                                                  result_path="results/x.pdf", media_type="application/pdf"))).after
    assert (done.progress, done.result_path, done.media_type) == (100, "results/x.pdf", "application/pdf")
    assert done.expires_at == done.finished_at == done.updated_at
    other = (await store.accept(new_job())).job  # alive: not expired

    at = await store.clock() + STAMP_SLACK_S
    expired = await store.expired(at)
    assert [j.id for j in expired] == [job.id]
    await store.forget(expired + expired, at)  # listed twice: still one tombstone

    assert await store.get(job.id) is None
    assert await store.tombstone_tenant(job.id) == "t1"
    assert await store.tombstone_tenant(other.id) is None
    assert await store.job_events(job.id, 0) == []
    assert await store.get(other.id) == other
    again = await store.accept(new_job(), key)  # the key went with the job
    assert not again.replayed and again.job.id != job.id


async def test_two_gateways_forget_the_same_jobs_at_once(stores: Stores) -> None:
    a, b = (await stores.another(retention_s=0.0)).jobs, (await stores.another(retention_s=0.0)).jobs
    ids = []
    for i in range(30):
        job = (await a.accept(new_job(), claim_key(f"k{i}"))).job
        await a.transition(job.id, Change(expect={"queued"}, to="cancelled"))
        ids.append(job.id)
    at = await a.clock() + STAMP_SLACK_S
    doomed = await a.expired(at)
    assert sorted(j.id for j in doomed) == sorted(ids)

    # Each sweep forgets what the other is not forgetting at that moment; neither waits.
    results = await outcomes([sweeper.forget(doomed, at) for sweeper in (a, b, a, b)])
    assert results == [None] * 4

    assert await a.expired(await a.clock() + STAMP_SLACK_S) == []
    assert [await b.tombstone_tenant(i) for i in ids] == ["t1"] * 30
    assert [await b.get(i) for i in ids] == [None] * 30
    assert not (await a.accept(new_job(), claim_key("k7"))).replayed  # keys went with their jobs


async def test_list_jobs_newest_first_with_filters_and_cursor(stores: Stores) -> None:
    store = stores.jobs
    ids = [(await store.accept(new_job())).job.id for _ in range(5)]
    await store.transition(ids[1], Change(expect={"queued"}, to="cancelled"))

    page = await store.list_jobs("t1", state=None, kind=None, before=None, limit=3)
    assert [j.id for j in page] == ids[::-1][:3]
    cursor = (page[-1].created_at, page[-1].id)
    assert [j.id for j in await store.list_jobs("t1", state=None, kind=None, before=cursor, limit=3)] == ids[1::-1]
    assert [j.id for j in await store.list_jobs("t1", state="cancelled", kind="report", before=None, limit=9)] == [ids[1]]
    assert await store.list_jobs("t1", state=None, kind="export", before=None, limit=9) == []


# ----- queue ages, shared secrets ----------------------------------------------------------


async def test_a_tenants_own_queue_age(stores: Stores) -> None:
    """The backlog guard's read: the age of one tenant's oldest queued job of a kind."""
    store = stores.jobs
    await store.accept(new_job("slow"))
    assert await store.tenant_queued_age("report", "slow") >= 0.0
    assert await store.tenant_queued_age("report", "idle") == 0.0
    assert await store.tenant_queued_age("export", "slow") == 0.0


async def test_queued_ages_per_kind(stores: Stores) -> None:
    """Per-kind queue age (/metrics, back-pressure): the oldest queued job's age, 0.0 when none is queued."""
    store = stores.jobs
    first = (await store.accept(new_job("t1"))).job
    await store.accept(new_job("t2"))
    ages = await store.queued_ages(["report", "export"])
    assert set(ages) == {"report", "export"} and ages["export"] == 0.0
    assert 0.0 <= ages["report"] <= await store.clock() - first.created_at + 1e-6
    older = ages["report"]
    assert (await store.queued_ages(["report"]))["report"] >= older  # the oldest one's, and it ages
    for job in await store.list_jobs("t1", state="queued", kind=None, before=None, limit=10) + \
            await store.list_jobs("t2", state="queued", kind=None, before=None, limit=10):
        await store.transition(job.id, CLAIM)
    assert await store.queued_ages(["report"]) == {"report": 0.0}


async def test_queue_ages_are_the_oldest_queued_job_over_every_tenant_and_kind(stores: Stores) -> None:
    """/metrics' ages read one index tenant by tenant and kind by kind (migration 5 on SQLite,
    16 on PostgreSQL): each kind's oldest queued job wherever it is -- behind another kind of
    the same tenant, in a tenant that sorts last -- and the oldest of all for the store."""
    store = stores.jobs

    async def accept(tenant: str, kind: str) -> JobRow:
        return (await store.accept(dataclasses.replace(new_job(tenant), kind=kind))).job

    oldest_report = await accept("z-last", "report")
    oldest_export = await accept("a-first", "export")
    claimed = await accept("a-first", "report")
    next_report = await accept("a-first", "report")
    await accept("m-middle", "export")
    await accept("z-last", "zip")
    await store.transition(claimed.id, CLAIM)  # running: no longer queued

    def within(age: float, job: JobRow, before: float, after: float) -> bool:
        return before - job.created_at - 1e-6 <= age <= after - job.created_at + 1e-6

    before = await store.clock()
    ages = await store.queued_ages(["report", "export", "none"])
    stats = await store.stats()
    after = await store.clock()
    assert set(ages) == {"report", "export", "none"} and ages["none"] == 0.0
    assert within(ages["report"], oldest_report, before, after)
    assert within(ages["export"], oldest_export, before, after)
    assert within(stats.oldest_queued_age_s, oldest_report, before, after)

    await store.transition(oldest_report.id, CLAIM)
    before = await store.clock()
    later = await store.queued_ages(["report"])
    after = await store.clock()
    assert within(later["report"], next_report, before, after)  # the next one's


async def test_signing_key_is_the_same_for_every_process(stores: Stores) -> None:
    a, b = stores.jobs, (await stores.another()).jobs
    keys = await asyncio.gather(*((a if i % 2 else b).signing_key() for i in range(10)))
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert await a.signing_key() == keys[0]
