"""The PostgreSQL webhook store and delivery queue against a real server, with real concurrency.

Each test gets a fresh database (``fresh_database``) on the session's server. "Two
notifiers" are two ``PgDatabase`` pools on that database, so their claims and fan-outs
really run in separate transactions at the same time.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import pytest

from herald.deliveries import CALLBACK_PREFIX, PROGRESS_INTERVAL_S, Attempted, Claimed, callback_owner, new_test_event
from herald.storage.postgres.db import PgDatabase
from herald.storage.postgres.schema import SCHEMA
from herald.storage.postgres.webhooks import PgDeliveryQueue, PgWebhookStore
from notifier.delivery import Outcome
from notifier.retry import ENDPOINT_DISABLE_AFTER_S, Plan
from notifier.signing import ROTATION_OVERLAP_S
from schemas import JobEvent
from tests import delivery_batches, portal_store
from tests.harness import make_sealer

ALL_TYPES = ("job.queued", "job.running", "job.progress", "job.succeeded", "job.failed", "job.cancelled")
OK = Outcome(status_code=200, latency_s=0.012)
FAILED = Outcome(status_code=500, latency_s=0.02, error="HTTP 500", response=b"boom")
GONE = Outcome(status_code=410, latency_s=0.01)


@pytest.fixture()
async def db(fresh_database: str) -> AsyncIterator[PgDatabase]:
    database = PgDatabase(fresh_database, SCHEMA, max_size=12)
    await database.open()
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture()
async def other_db(fresh_database: str, db: PgDatabase) -> AsyncIterator[PgDatabase]:
    """A second process's pool on the same database (a second notifier or gateway)."""
    database = PgDatabase(fresh_database, SCHEMA, max_size=12)
    await database.open()
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture()
def webhooks(db: PgDatabase) -> PgWebhookStore:
    return PgWebhookStore(db, make_sealer())


@pytest.fixture()
def queue(db: PgDatabase) -> PgDeliveryQueue:
    return PgDeliveryQueue(db, make_sealer())


def event(job_id: str, version: int, type: str = "job.succeeded", *, tenant: str = "t1", kind: str = "echo") -> JobEvent:
    data = msgspec.json.encode({"id": job_id, "version": version})
    return JobEvent(seq=version, tenant=tenant, job_id=job_id, kind=kind, version=version, type=type,
                    at="2026-01-01T00:00:00Z", data=msgspec.Raw(data))


async def endpoint(webhooks: PgWebhookStore, tenant: str = "t1", **options: Any) -> str:
    options.setdefault("url", "https://example.com/hook")
    options.setdefault("event_types", ALL_TYPES)
    options.setdefault("kinds", None)
    options.setdefault("signature", "hmac-sha256")
    row, _ = await webhooks.create_endpoint(tenant, **options)
    return row.id


async def insert_job(db: PgDatabase, job_id: str, callback_url: str | None, tenant: str = "t1") -> None:
    """A job row with a callback URL, whatever else the job store's table requires."""
    dummies = {"text": "x", "integer": 1, "bigint": 1, "smallint": 1, "double precision": 0.0, "real": 0.0,
               "numeric": 0, "bytea": b"", "boolean": False, "jsonb": "{}", "json": "{}"}
    columns = await db.pool.fetch(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'jobs'"
        " AND is_nullable = 'NO' AND column_default IS NULL")
    values: dict[str, Any] = {"id": job_id, "callback_url": callback_url}
    for c in columns:
        values.setdefault(c["column_name"], tenant if c["column_name"] == "tenant" else dummies[c["data_type"]])
    names = ", ".join(values)
    marks = ", ".join(f"${n}" for n in range(1, len(values) + 1))
    await db.pool.execute(f"INSERT INTO jobs ({names}) VALUES ({marks})", *values.values())


async def claim(queue: PgDeliveryQueue, owner: str = "n1", *, per_target: int = 10, limit: int = 100,
                lease_s: float = 30.0, in_flight: dict[str, int] | None = None) -> list[Claimed]:
    return await queue.claim(owner, lease_s=lease_s, per_target=per_target, limit=limit, in_flight=in_flight or {})


async def deliveries(db: PgDatabase, **where: Any) -> list[dict[str, Any]]:
    clauses = " AND ".join(f"{k} = ${n}" for n, k in enumerate(where, start=1)) or "TRUE"
    rows = await db.pool.fetch(f"SELECT * FROM webhook_deliveries WHERE {clauses} ORDER BY seq", *where.values())
    return [dict(r) for r in rows]


async def finish(queue: PgDeliveryQueue, db: PgDatabase, item: Claimed, outcome: Outcome, plan: Plan,
                 owner: str = "n1") -> Any:
    return await queue.finish(item, owner, await db.clock(), outcome, plan)


# ----- endpoints and keys -------------------------------------------------------------------


async def test_endpoint_crud_and_tenant_isolation(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                  db: PgDatabase) -> None:
    before = await db.clock()
    row, key = await webhooks.create_endpoint("t1", url="https://a.example/hook", event_types=["job.succeeded"],
                                           kinds=["echo"], signature="hmac-sha256")
    assert (row.tenant, row.url, row.event_types, row.kinds, row.status) == (
        "t1", "https://a.example/hook", ("job.succeeded",), ("echo",), "enabled")
    assert row.created_at >= before and key.shown_secret and key.shown_secret.startswith("whsec_")
    _, ed_key = await webhooks.create_endpoint("t1", url="https://b.example/hook", event_types=["job.failed"],
                                            kinds=None, signature="ed25519")
    assert ed_key.shown_public_key and ed_key.shown_public_key.startswith("whpk_")

    assert await webhooks.get_endpoint("t1", row.id) == row
    assert await webhooks.get_endpoint("t2", row.id) is None
    assert await webhooks.update_endpoint("t2", row.id, {"url": "https://evil.example"}) is None
    assert await webhooks.rotate_endpoint_key("t2", row.id) is None
    assert await webhooks.delete_endpoint("t2", row.id) is False
    assert await webhooks.list_endpoints("t2", before=None, limit=10) == []

    # Newest first, paged by (created_at, id).
    ids = [row.id] + [await endpoint(webhooks, url=f"https://{n}.example/hook") for n in range(3)]
    listed = await webhooks.list_endpoints("t1", before=None, limit=2)
    rest = await webhooks.list_endpoints("t1", before=(listed[-1].created_at, listed[-1].id), limit=10)
    assert len(listed) == 2 and len(rest) == 3
    assert {e.id for e in listed + rest} >= set(ids) and len({e.id for e in listed + rest}) == 5

    updated = await webhooks.update_endpoint("t1", row.id, {"url": "https://c.example/hook",
                                                         "event_types": ["job.failed", "job.succeeded"],
                                                         "kinds": None})
    assert updated is not None
    assert (updated.url, updated.event_types, updated.kinds) == (
        "https://c.example/hook", ("job.failed", "job.succeeded"), None)
    assert updated.updated_at >= row.updated_at

    # Disabling fails what was waiting, and later events are dropped, not queued.
    assert await queue.fan_out([event("j1", 1)]) == 1 + 3  # this endpoint and the three others
    disabled = await webhooks.update_endpoint("t1", row.id, {"status": "disabled"})
    assert disabled is not None and disabled.status == "disabled"
    assert [d["status"] for d in await deliveries(db, endpoint_id=row.id)] == ["failed"]
    assert await queue.fan_out([event("j2", 1)]) == 3
    assert await deliveries(db, endpoint_id=row.id, job_id="j2") == []

    # Re-enabling restarts the 5-day clock.
    await db.pool.execute("UPDATE webhook_endpoints SET failing_since = 1 WHERE id = $1", row.id)
    enabled = await webhooks.update_endpoint("t1", row.id, {"status": "enabled"})
    assert enabled is not None and enabled.status == "enabled" and enabled.failing_since is None

    # Delete takes the keys, deliveries and attempts with it.
    item = next(c for c in await claim(queue) if c.delivery.endpoint_id == ids[1])
    await finish(queue, db, item, OK, Plan("delivered"))
    assert await webhooks.delete_endpoint("t1", ids[1]) is True
    assert await webhooks.get_endpoint("t1", ids[1]) is None
    assert await deliveries(db, endpoint_id=ids[1]) == []
    assert await webhooks.attempts([item.delivery.id]) == {item.delivery.id: []}
    assert await db.pool.fetchval("SELECT count(*) FROM webhook_keys WHERE owner = $1", ids[1]) == 0
    assert await webhooks.delete_endpoint("t1", ids[1]) is False


async def test_rotation_keeps_both_keys_signing_for_the_overlap(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                                db: PgDatabase) -> None:
    row, first = await webhooks.create_endpoint("t1", url="https://a.example/hook", event_types=["job.succeeded"],
                                             kinds=None, signature="hmac-sha256")
    second = await webhooks.rotate_endpoint_key("t1", row.id)
    assert second is not None and second != first

    await queue.fan_out([event("j1", 1)])
    (item,) = await claim(queue)
    assert item.keys == (second, first)  # newest first: both sign during the overlap
    retire_at = await db.pool.fetchval("SELECT retire_at FROM webhook_keys WHERE owner = $1 AND retire_at IS NOT NULL",
                                       row.id)
    assert retire_at == pytest.approx(await db.clock() + ROTATION_OVERLAP_S, abs=5)

    # Once the overlap is over only the current key signs, and the next rotation drops the old one.
    await db.pool.execute("UPDATE webhook_keys SET retire_at = 1 WHERE owner = $1 AND retire_at IS NOT NULL", row.id)
    await queue.fan_out([event("j2", 1)])
    (item2,) = [c for c in await claim(queue, "n2") if c.delivery.job_id == "j2"]
    assert item2.keys == (second,)
    third = await webhooks.rotate_endpoint_key("t1", row.id)
    assert await db.pool.fetchval("SELECT count(*) FROM webhook_keys WHERE owner = $1", row.id) == 2
    assert third is not None and third not in (first, second)

    # Concurrent rotations of one owner take turns: one current key, the others overlapping.
    await asyncio.gather(*(webhooks.rotate_endpoint_key("t1", row.id) for _ in range(5)))
    assert await db.pool.fetchval(
        "SELECT count(*) FROM webhook_keys WHERE owner = $1 AND retire_at IS NULL", row.id) == 1
    assert await db.pool.fetchval("SELECT count(*) FROM webhook_keys WHERE owner = $1", row.id) == 7

    # The callback secret rotates the same way.
    old = await webhooks.callback_key("t1")
    new = await webhooks.rotate_callback_key("t1")
    assert new != old and await webhooks.callback_key("t1") == new
    assert await db.pool.fetchval("SELECT count(*) FROM webhook_keys WHERE owner = $1 AND retire_at > 0",
                                  callback_owner("t1")) == 1


async def test_callback_key_is_created_once_under_concurrent_first_use(
    webhooks: PgWebhookStore, db: PgDatabase, other_db: PgDatabase
) -> None:
    other = PgWebhookStore(other_db, make_sealer())
    keys = await asyncio.gather(*(s.callback_key("t1") for s in [webhooks, other] * 5))
    assert len(set(keys)) == 1
    assert await db.pool.fetchval("SELECT count(*) FROM webhook_keys WHERE owner = $1", callback_owner("t1")) == 1
    assert await webhooks.callback_key("t2") != keys[0]  # per tenant


# ----- fan-out ---------------------------------------------------------------------------------


async def test_fan_out_matches_endpoints_and_is_idempotent(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                           db: PgDatabase) -> None:
    succeeded_only = await endpoint(webhooks, event_types=["job.succeeded"])
    echo_only = await endpoint(webhooks, event_types=ALL_TYPES, kinds=["echo"])
    await endpoint(webhooks, tenant="t2")  # another tenant's: never sees t1's events
    await insert_job(db, "j1", "https://cb.example/done")
    await insert_job(db, "j2", None)

    events = [event("j1", 1, "job.running"), event("j1", 2, "job.succeeded"),
              event("j2", 1, "job.succeeded", kind="pdf")]
    # j1.1 -> echo_only + callback; j1.2 -> both + callback; j2.1 -> succeeded_only
    assert await queue.fan_out(events) == 6
    assert await queue.fan_out(events) == 0
    assert await queue.fan_out(events[1:]) == 0
    rows = await deliveries(db)
    assert len(rows) == 6
    assert {(r["target"], r["event_id"]) for r in rows} == {
        (echo_only, "evt_j1.1"), (CALLBACK_PREFIX + "https://cb.example/done", "evt_j1.1"),
        (succeeded_only, "evt_j1.2"), (echo_only, "evt_j1.2"), (CALLBACK_PREFIX + "https://cb.example/done", "evt_j1.2"),
        (succeeded_only, "evt_j2.1"),
    }
    assert await db.pool.fetchval("SELECT count(*) FROM webhook_messages") == 3
    assert await queue.fan_out([]) == 0

    # Concurrent redeliveries of one batch to two notifiers create nothing twice either.
    twice = [event(f"k{n}", 1) for n in range(20)]
    second = PgDeliveryQueue(db, make_sealer())
    counts = await asyncio.gather(queue.fan_out(twice), second.fan_out(twice), queue.fan_out(twice))
    assert sum(counts) == 40  # two endpoints want job.succeeded of kind echo
    assert len(await deliveries(db)) == 46


async def test_callback_deliveries_skip_progress_and_sign_with_the_tenant_secret(
    webhooks: PgWebhookStore, queue: PgDeliveryQueue, db: PgDatabase
) -> None:
    await insert_job(db, "j1", "https://cb.example/done")
    assert await queue.fan_out([event("j1", 1, "job.progress")]) == 0  # callbacks never get progress
    assert await queue.fan_out([event("j1", 2, "job.running")]) == 1
    (item,) = await claim(queue)
    assert item.url == "https://cb.example/done" and item.delivery.endpoint_id is None
    assert item.delivery.url == "https://cb.example/done"
    assert item.keys == (await webhooks.callback_key("t1"),)  # created on first use, the same one the API shows
    payload = msgspec.json.decode(item.body)
    assert payload == {"type": "job.running", "timestamp": "2026-01-01T00:00:00Z",
                       "data": {"id": "j1", "version": 2}}


# ----- order per job and target ------------------------------------------------------------------


async def test_newer_version_waits_while_an_older_one_is_pending(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                                 db: PgDatabase) -> None:
    await endpoint(webhooks)
    await queue.fan_out([event("j1", 1, "job.running"), event("j1", 2, "job.succeeded")])
    (first,) = await claim(queue)
    assert first.delivery.version == 1
    assert await claim(queue, "n2") == []  # v1 is in flight: v2 must not overtake it
    await finish(queue, db, first, OK, Plan("delivered"))
    (second,) = await claim(queue)
    assert second.delivery.version == 2


async def test_superseding(webhooks: PgWebhookStore, queue: PgDeliveryQueue, db: PgDatabase) -> None:
    target = await endpoint(webhooks)

    # A failed v1 waiting for its retry is superseded by v2 arriving.
    await queue.fan_out([event("a", 1, "job.running")])
    (a1,) = await claim(queue)
    done = await finish(queue, db, a1, FAILED, Plan("retry", delay_s=60))
    assert done.status == "pending"
    assert await queue.fan_out([event("a", 2, "job.succeeded")]) == 1
    assert (await deliveries(db, event_id="evt_a.1"))[0]["status"] == "superseded"
    (a2,) = await claim(queue)
    assert a2.delivery.version == 2

    # A v1 failing after v2 was recorded is superseded instead of retried.
    await queue.fan_out([event("b", 1, "job.running")])
    (b1,) = [c for c in await claim(queue) if c.delivery.job_id == "b"]
    await queue.fan_out([event("b", 2, "job.succeeded")])
    done = await finish(queue, db, b1, FAILED, Plan("retry", delay_s=60))
    assert (done.status, done.next_attempt_at) == ("superseded", None)

    # An event arriving after a newer one of its job was sent would go back in time: superseded at once.
    await queue.fan_out([event("c", 2, "job.succeeded")])
    (c2,) = [c for c in await claim(queue) if c.delivery.job_id == "c"]
    assert await queue.fan_out([event("c", 1, "job.running")]) == 0
    assert [(r["version"], r["status"]) for r in await deliveries(db, job_id="c")] == [(2, "pending"), (1, "superseded")]
    assert c2.delivery.target == target

    # ... but if the newer one was not sent yet, the older one goes first.
    await queue.fan_out([event("d", 2, "job.succeeded")])
    assert await queue.fan_out([event("d", 1, "job.running")]) == 1
    got = [c for c in await claim(queue, "n3") if c.delivery.job_id == "d"]
    assert [c.delivery.version for c in got] == [1]


async def test_progress_is_throttled_per_job_and_target(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                        db: PgDatabase) -> None:
    await endpoint(webhooks)
    await queue.fan_out([event("j1", 1, "job.progress")])
    (p1,) = await claim(queue)
    await finish(queue, db, p1, OK, Plan("delivered"))
    sent_at = p1.delivery.scheduled_at

    await queue.fan_out([event("j1", 2, "job.progress")])
    await queue.fan_out([event("j1", 3, "job.progress")])  # supersedes v2, which was not sent yet
    rows = {r["version"]: r for r in await deliveries(db, job_id="j1")}
    assert rows[2]["status"] == "superseded"
    assert rows[3]["status"] == "pending"
    assert rows[3]["next_attempt_at"] == pytest.approx(sent_at + PROGRESS_INTERVAL_S)
    assert await claim(queue) == []  # not yet: one per second

    # A state change is not throttled and supersedes the waiting progress.
    assert await queue.fan_out([event("j1", 4, "job.succeeded")]) == 1
    assert (await deliveries(db, event_id="evt_j1.3"))[0]["status"] == "superseded"
    (last,) = await claim(queue)
    assert last.delivery.version == 4


async def test_per_target_cap_counts_what_this_notifier_has_in_flight(
    webhooks: PgWebhookStore, queue: PgDeliveryQueue, db: PgDatabase
) -> None:
    busy = await endpoint(webhooks, url="https://busy.example/hook")
    await queue.fan_out([event(f"j{n}", 1) for n in range(5)])
    assert len(await claim(queue, per_target=2)) == 2
    assert len(await claim(queue, "n2", per_target=2, in_flight={busy: 1})) == 1
    assert await claim(queue, "n3", per_target=2, in_flight={busy: 2}) == []
    assert len(await claim(queue, "n4", per_target=2, limit=1)) == 1


async def test_two_notifiers_claiming_at_once_never_share_a_delivery(
    webhooks: PgWebhookStore, db: PgDatabase, other_db: PgDatabase
) -> None:
    for n in range(20):
        await endpoint(webhooks, url=f"https://{n}.example/hook")
    notifiers = [PgDeliveryQueue(db, make_sealer()), PgDeliveryQueue(other_db, make_sealer())]
    assert await notifiers[0].fan_out([event(f"j{n}", 1) for n in range(10)]) == 200

    async def claimer(queue: PgDeliveryQueue, owner: str) -> list[str]:
        got: list[str] = []
        while batch := await claim(queue, owner, per_target=100, limit=7):
            got += [c.delivery.id for c in batch]
        return got

    results = await asyncio.gather(*(claimer(notifiers[n % 2], f"n{n % 2}") for n in range(8)))
    claimed = list(itertools.chain.from_iterable(results))
    assert len(claimed) == len(set(claimed)) == 200
    assert all(results[0::2]) and all(results[1::2])  # both notifiers got work
    rows = await deliveries(db)
    assert {r["id"] for r in rows} == set(claimed)
    assert all(r["lease_owner"] in ("n0", "n1") and r["lease_until"] is not None for r in rows)
    assert not await notifiers[1].anything_due()


async def test_order_holds_while_two_notifiers_fan_out_and_claim_concurrently(
    webhooks: PgWebhookStore, db: PgDatabase, other_db: PgDatabase
) -> None:
    """v1 and v2 of each job are fanned out by different notifiers at the same moment, while
    both claim and deliver: no v2 is ever claimed while its v1 can still be sent."""
    await endpoint(webhooks)
    a, b = PgDeliveryQueue(db, make_sealer()), PgDeliveryQueue(other_db, make_sealer())
    jobs = [f"j{n}" for n in range(60)]
    log: list[tuple[str, str]] = []  # ("claim" | "finish", delivery id), in order
    fanning = True

    async def fan(queue: PgDeliveryQueue, version: int, order: Sequence[str]) -> None:
        for job in order:
            await queue.fan_out([event(job, version, "job.running" if version == 1 else "job.succeeded")])
            await asyncio.sleep(0)

    async def notifier(queue: PgDeliveryQueue, owner: str, database: PgDatabase) -> None:
        while True:
            batch = await claim(queue, owner, per_target=1000, limit=5)
            log.extend(("claim", c.delivery.id) for c in batch)
            for item in batch:
                await queue.finish(item, owner, await database.clock(), OK, Plan("delivered"))
                log.append(("finish", item.delivery.id))
            if not batch and not fanning and not await queue.anything_due():
                return
            await asyncio.sleep(0)

    workers = [asyncio.create_task(notifier(q, f"n{n}", d)) for n, (q, d) in enumerate([(a, db), (b, other_db)] * 3)]
    # Several fan-outs per side, so that v1 and v2 of a job often meet in flight.
    await asyncio.gather(*(fan(a, 2, jobs[n::3]) for n in range(3)), *(fan(b, 1, jobs[::-1][n::3]) for n in range(3)))
    fanning = False
    await asyncio.gather(*workers)

    position = {(kind, delivery): n for n, (kind, delivery) in enumerate(log)}
    assert len(position) == len(log)  # nothing claimed or finished twice
    for row in await deliveries(db):
        assert row["status"] in ("delivered", "superseded"), row
    for job in jobs:
        rows = {r["version"]: r for r in await deliveries(db, job_id=job)}
        assert rows[2]["status"] == "delivered"
        if rows[1]["status"] == "delivered":
            assert position[("finish", rows[1]["id"])] < position[("claim", rows[2]["id"])], job
        else:
            assert ("claim", rows[1]["id"]) not in position


# ----- finishing, leases, retention -------------------------------------------------------------


async def test_retry_is_scheduled_by_the_database_clock(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                        db: PgDatabase) -> None:
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1)])
    (item,) = await claim(queue)
    before = await db.clock()
    done = await finish(queue, db, item, FAILED, Plan("retry", delay_s=30))
    after = await db.clock()
    assert done.status == "pending" and not done.endpoint_disabled
    assert done.next_attempt_at is not None and before + 30 <= done.next_attempt_at <= after + 30

    row = await webhooks.get_delivery(endpoint_id, item.delivery.id)
    assert row is not None
    assert (row.status, row.attempts, row.lease_owner, row.lease_until) == ("pending", 1, None, None)
    assert row.next_attempt_at == done.next_attempt_at
    (attempt,) = (await webhooks.attempts([row.id]))[row.id]
    assert (attempt.n, attempt.status_code, attempt.error, attempt.response) == (1, 500, "HTTP 500", b"boom")
    assert attempt.latency_ms == pytest.approx(20.0)
    endpoint_row = await webhooks.get_endpoint("t1", endpoint_id)
    assert endpoint_row is not None and endpoint_row.failing_since is not None

    assert await claim(queue) == [] and not await queue.anything_due()
    assert await queue.next_due_after(before) == pytest.approx(done.next_attempt_at)
    await db.pool.execute("UPDATE webhook_deliveries SET next_attempt_at = next_attempt_at - 31")
    (again,) = await claim(queue)
    assert again.delivery.id == item.delivery.id and again.delivery.attempts == 1
    done = await finish(queue, db, again, OK, Plan("delivered"))
    assert (done.status, done.next_attempt_at) == ("delivered", None)
    assert [a.n for a in (await webhooks.attempts([row.id]))[row.id]] == [1, 2]
    endpoint_row = await webhooks.get_endpoint("t1", endpoint_id)
    assert endpoint_row is not None and endpoint_row.failing_since is None  # healthy again


async def test_410_disables_the_endpoint_and_fails_its_pending(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                              db: PgDatabase) -> None:
    gone = await endpoint(webhooks, url="https://gone.example/hook")
    fine = await endpoint(webhooks, url="https://fine.example/hook")
    await queue.fan_out([event(f"j{n}", 1) for n in range(3)])
    item = next(c for c in await claim(queue, per_target=1) if c.delivery.endpoint_id == gone)
    done = await finish(queue, db, item, GONE, Plan("failed", disable_endpoint=True))
    assert (done.status, done.endpoint_disabled) == ("failed", True)
    endpoint_row = await webhooks.get_endpoint("t1", gone)
    assert endpoint_row is not None and endpoint_row.status == "disabled"
    rows = await deliveries(db, endpoint_id=gone)
    assert sorted(r["status"] for r in rows) == ["failed"] * 3
    assert next(r for r in rows if r["id"] == item.delivery.id)["attempts"] == 1
    assert {r["status"] for r in await deliveries(db, endpoint_id=fine)} == {"pending"}


async def test_an_endpoint_failing_for_five_days_is_disabled(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                             db: PgDatabase) -> None:
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1), event("j2", 1)])
    first, _ = await claim(queue)
    await db.pool.execute("UPDATE webhook_endpoints SET failing_since = $2 WHERE id = $1",
                          endpoint_id, await db.clock() - ENDPOINT_DISABLE_AFTER_S - 1)
    done = await finish(queue, db, first, FAILED, Plan("retry", delay_s=10))
    assert (done.status, done.next_attempt_at, done.endpoint_disabled) == ("failed", None, True)
    assert {r["status"] for r in await deliveries(db)} == {"failed"}


async def test_finish_after_the_endpoint_was_deleted_is_dropped(webhooks: PgWebhookStore, queue: PgDeliveryQueue,
                                                                db: PgDatabase) -> None:
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1)])
    (item,) = await claim(queue)
    assert await webhooks.delete_endpoint("t1", endpoint_id)
    done = await finish(queue, db, item, OK, Plan("delivered"))
    assert done.status == "dropped"
    assert await db.pool.fetchval("SELECT count(*) FROM webhook_attempts") == 0


async def test_leases_release_and_expiry(webhooks: PgWebhookStore, queue: PgDeliveryQueue, db: PgDatabase,
                                         other_db: PgDatabase) -> None:
    await endpoint(webhooks)
    other = PgDeliveryQueue(other_db, make_sealer())
    await queue.fan_out([event("j1", 1), event("j2", 1)])
    held = await claim(queue, "n1")
    assert len(held) == 2 and await claim(other, "n2") == []

    await queue.release([held[0].delivery.id], "someone-else")  # only the holder can release
    assert await claim(other, "n2") == []
    await queue.release([held[0].delivery.id], "n1")
    (taken,) = await claim(other, "n2")
    assert taken.delivery.id == held[0].delivery.id and taken.delivery.lease_owner == "n2"

    # A killed notifier's lease runs out on the database's clock; its late finish changes nothing.
    await db.pool.execute("UPDATE webhook_deliveries SET lease_until = $2 WHERE id = $1",
                          held[1].delivery.id, await db.clock() - 1)
    (recovered,) = await claim(other, "n2")
    assert recovered.delivery.id == held[1].delivery.id
    await finish(queue, db, held[1], OK, Plan("delivered"), owner="n1")
    (row,) = await deliveries(db, id=held[1].delivery.id)
    assert (row["status"], row["lease_owner"]) == ("pending", "n2")


async def test_retry_now(webhooks: PgWebhookStore, queue: PgDeliveryQueue, db: PgDatabase) -> None:
    endpoint_id = await endpoint(webhooks)
    other_endpoint = await endpoint(webhooks, url="https://other.example/hook")
    await queue.fan_out([event("j1", 1)])
    item = next(c for c in await claim(queue) if c.delivery.endpoint_id == endpoint_id)
    await finish(queue, db, item, FAILED, Plan("failed"))

    assert await webhooks.retry_now(other_endpoint, item.delivery.id) is None
    before = await db.clock()
    row = await webhooks.retry_now(endpoint_id, item.delivery.id)
    assert row is not None
    assert (row.id, row.event_id, row.status) == (item.delivery.id, "evt_j1.1", "pending")
    assert row.next_attempt_at is not None and row.next_attempt_at >= before
    (again,) = [c for c in await claim(queue) if c.delivery.endpoint_id == endpoint_id]
    assert again.delivery.id == item.delivery.id

    listed = await webhooks.list_deliveries(endpoint_id, status="pending", before_seq=None, limit=10)
    assert [d.id for d in listed] == [item.delivery.id]
    assert await webhooks.list_deliveries(endpoint_id, status="failed", before_seq=None, limit=10) == []
    assert await webhooks.list_deliveries(endpoint_id, status=None, before_seq=row.seq, limit=10) == []
    assert await webhooks.get_delivery(other_endpoint, item.delivery.id) is None


async def test_prune_forgets_finished_deliveries_with_their_attempts(
    webhooks: PgWebhookStore, queue: PgDeliveryQueue, db: PgDatabase
) -> None:
    await endpoint(webhooks)
    await queue.fan_out([event("j1", 1), event("j2", 1), event("j3", 1)])
    items = await claim(queue)
    await finish(queue, db, items[0], OK, Plan("delivered"))
    await finish(queue, db, items[1], FAILED, Plan("failed"))
    cutoff = await db.clock() + 1
    assert await queue.prune(cutoff, limit=1) == 1
    assert await queue.prune(cutoff) == 1
    assert await queue.prune(cutoff) == 0
    (left,) = await deliveries(db)
    assert left["id"] == items[2].delivery.id and left["status"] == "pending"
    assert await db.pool.fetchval("SELECT count(*) FROM webhook_attempts") == 0
    assert await db.pool.fetch("SELECT event_id FROM webhook_messages") == [("evt_j3.1",)]


async def test_recover_test_events_and_health(webhooks: PgWebhookStore, queue: PgDeliveryQueue) -> None:
    await portal_store.recover_test_events_and_health(webhooks, queue)


async def test_recover_and_test_events_wait_for_nothing_a_concurrent_disable_misses(
        webhooks: PgWebhookStore, queue: PgDeliveryQueue, other_db: PgDatabase) -> None:
    """Recover and test events hold the endpoint as fan-out does: racing a disable from
    another pool, nothing is left pending on a disabled endpoint."""
    other = PgWebhookStore(other_db, make_sealer())
    for _ in range(10):
        endpoint_id = await endpoint(webhooks)
        assert await queue.fan_out([event(f"job-{endpoint_id}", 1)]) == 1
        [item] = await claim(queue)
        await queue.finish(item, "n1", 0.0, FAILED, Plan("failed"))
        body = b'{"type":"webhook.test"}'
        await asyncio.gather(
            webhooks.recover("t1", endpoint_id, 0),
            webhooks.add_test_delivery("t1", endpoint_id, *new_test_event(), body),
            other.update_endpoint("t1", endpoint_id, {"status": "disabled"}),
        )
        assert [r for r in await deliveries(webhooks.db, endpoint_id=endpoint_id) if r["status"] == "pending"] == []


async def test_many_attempts_recorded_in_one_batch(webhooks: PgWebhookStore, queue: PgDeliveryQueue) -> None:
    await delivery_batches.many_attempts_recorded_in_one_batch(webhooks, queue)


async def test_a_batch_of_outcomes_and_a_fan_out_of_the_same_jobs_at_once_do_not_deadlock(
    webhooks: PgWebhookStore, queue: PgDeliveryQueue, db: PgDatabase, other_db: PgDatabase
) -> None:
    """finish_many takes its order locks sorted, as fan-out does: both finish, and the retried
    deliveries with a newer version behind them end superseded."""
    await endpoint(webhooks)
    await endpoint(webhooks, url="https://example.com/other")
    jobs = [f"job-{n}" for n in range(20)]
    assert await queue.fan_out([event(j, 1, "job.queued") for j in jobs]) == 40
    claimed = await claim(queue, per_target=100)
    assert len(claimed) == 40
    attempts = [Attempted(claimed=c, started_at=0.0, outcome=FAILED, plan=Plan("retry", delay_s=60)) for c in claimed]
    other = PgDeliveryQueue(other_db, make_sealer())
    finished, pending = await asyncio.gather(
        queue.finish_many(attempts, "n1"), other.fan_out([event(j, 2, "job.running") for j in reversed(jobs)]))
    assert len(finished) == 40 and pending >= 0
    assert {f.status for f in finished} <= {"pending", "superseded"}
    rows = await deliveries(db)
    older = [r for r in rows if r["version"] == 1]
    assert all(r["attempts"] == 1 and r["lease_owner"] is None for r in older)
    # Whichever committed first, no version-1 delivery waits for a retry behind a version 2.
    assert all(r["status"] == "superseded" for r in older)
