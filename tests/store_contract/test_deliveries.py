"""The delivery queue's contract (``herald.storage.ports.DeliveryQueue``), on every backend:
fan-out, order per job and target, superseding, progress throttling, exclusive claims with
their caps, leases, outcomes (one or a batch), retention. "Two notifiers" are two
processes' queues on one database (``Stores.another``)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

import msgspec
import pytest

from herald.deliveries import (
    CALLBACK_PREFIX,
    DUE_PROBE_ROWS,
    TEST_JOB_PREFIX,
    Attempted,
    Claimed,
    FannedOut,
    LeaseOffer,
    Outcome,
    Plan,
)
from herald.delivery_rules import (
    DRAIN_TENANTS,
    ENDPOINT_DISABLE_AFTER_S,
    FAN_OUT_BATCH,
    FAN_OUT_SHARE,
    PROGRESS_INTERVAL_S,
    share_fan_out,
)
from herald.jobs import NewJob
from herald.storage.ports import DeliveryQueue, JobStore
from herald.transitions import Change
from schemas import JobEvent
from tests.store_contract.conftest import Stores
from tests.store_contract.support import (
    ALL_TYPES,
    FAILED,
    GONE,
    OK,
    claim,
    deliveries,
    endpoint,
    event,
    finish,
    new_job,
)


# ----- fan-out -------------------------------------------------------------------------------


async def test_fan_out_matches_endpoints_and_is_idempotent(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    succeeded_only = await endpoint(webhooks, event_types=["job.succeeded"])
    echo_only = await endpoint(webhooks, event_types=ALL_TYPES, kinds=["echo"])
    await endpoint(webhooks, tenant="t2")  # another tenant's: never sees t1's events
    await stores.jobs.accept(new_job(job_id="j1", callback_url="https://cb.example/done"))
    await stores.jobs.accept(new_job(job_id="j2"))

    events = [event("j1", 1, "job.running"), event("j1", 2, "job.succeeded"),
              event("j2", 1, "job.succeeded", kind="pdf")]
    # j1.1 -> echo_only + callback; j1.2 -> both + callback; j2.1 -> succeeded_only
    assert (await queue.fan_out(events)).pending == 6
    assert (await queue.fan_out(events)).pending == 0
    assert (await queue.fan_out(events[1:])).pending == 0
    rows = await deliveries(stores)
    assert len(rows) == 6
    assert {(r["target"], r["event_id"]) for r in rows} == {
        (echo_only, "evt_j1.1"), (CALLBACK_PREFIX + "https://cb.example/done", "evt_j1.1"),
        (succeeded_only, "evt_j1.2"), (echo_only, "evt_j1.2"), (CALLBACK_PREFIX + "https://cb.example/done", "evt_j1.2"),
        (succeeded_only, "evt_j2.1"),
    }
    assert await stores.count("webhook_messages") == 3
    assert (await queue.fan_out([])).pending == 0

    # Concurrent redeliveries of one batch to two notifiers create nothing twice either.
    twice = [event(f"k{n}", 1) for n in range(20)]
    second = (await stores.another()).deliveries
    counts = await asyncio.gather(queue.fan_out(twice), second.fan_out(twice), queue.fan_out(twice))
    assert sum(c.pending for c in counts) == 40  # two endpoints want job.succeeded of kind echo
    assert len(await deliveries(stores)) == 46


async def _two_jobs(jobs: JobStore) -> list[JobEvent]:
    """Two accepted jobs: their job.queued events, as the store committed them."""
    events = []
    for _ in range(2):
        job = NewJob(id=str(uuid.uuid4()), tenant="acme", kind="export", collection="/exports", params=b"{}",
                     deadline_s=60)
        event = (await jobs.accept(job)).event
        assert event is not None
        events.append(event)
    return events


async def _move(jobs: JobStore, job_id: str, change: Change) -> JobEvent:
    event = (await jobs.transition(job_id, change)).event
    assert event is not None
    return event


async def test_fan_out_of_committed_events_is_idempotent_and_a_late_older_event_is_superseded(
    stores: Stores,
) -> None:
    """The events as the job store commits them, fanned out in the order NATS may hand them over."""
    webhooks, queue, store = stores.webhooks, stores.deliveries, stores.jobs
    endpoint_row, _key = await webhooks.create_endpoint("acme", url="https://hooks.example.com/x",
                                                        event_types=["job.queued", "job.running"], kinds=None,
                                                        signature="hmac-sha256")
    queued, other = await _two_jobs(store)
    running = await _move(store, queued.job_id, Change(expect={"queued"}, to="running", claim=True))
    done = await _move(store, queued.job_id, Change(expect={"running"}, to="cancelled"))
    assert (await queue.fan_out([running])).pending == 1
    # running is not sent yet, so queued (late) still goes first, and running waits behind it
    assert (await queue.fan_out([queued, running, other])).pending == 2
    assert (await queue.fan_out([queued, running, other])).pending == 0  # a redelivered batch creates nothing
    claimed = await queue.claim("test", lease_s=30, per_target=8, limit=10, in_flight={})
    assert sorted((c.delivery.job_id == queued.job_id, c.delivery.version) for c in claimed) == [
        (False, 1), (True, 1)]
    for item in claimed:
        await queue.finish(item, "test", time.time(), Outcome(status_code=200, latency_s=0.01), Plan("delivered"))
    sent = await queue.claim("test", lease_s=30, per_target=8, limit=10, in_flight={})
    assert [(c.delivery.version, c.delivery.type) for c in sent] == [(2, "job.running")]
    assert (await queue.fan_out([done])).pending == 0  # job.cancelled: not subscribed
    # queued arrives once more, late, as if never seen (its row forgotten): running was sent
    # meanwhile, so sending queued now would go back in time
    await stores.sql("DELETE FROM webhook_deliveries WHERE job_id = $1 AND version = 1", queued.job_id)
    assert (await queue.fan_out([queued])).pending == 0
    rows = await webhooks.list_deliveries(endpoint_row.id, status=None, before_seq=None, limit=10)
    assert sorted((r.version, r.status) for r in rows if r.job_id == queued.job_id) == [
        (1, "superseded"), (2, "pending")]


async def test_callback_deliveries_skip_progress_and_sign_with_the_tenant_secret(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    await stores.jobs.accept(new_job(job_id="j1", callback_url="https://cb.example/done"))
    assert (await queue.fan_out([event("j1", 1, "job.progress")])).pending == 0  # callbacks never get progress
    assert (await queue.fan_out([event("j1", 2, "job.running")])).pending == 1
    (item,) = await claim(queue)
    assert item.url == "https://cb.example/done" and item.delivery.endpoint_id is None
    assert item.delivery.url == "https://cb.example/done"
    assert item.keys == (await webhooks.callback_key("t1"),)  # created on first use, the same one the API shows
    payload = msgspec.json.decode(item.body)
    assert payload == {"type": "job.running", "timestamp": "2026-01-01T00:00:00Z",
                       "data": {"id": "j1", "version": 2}}


async def test_delivery_ids_are_uuid7_made_in_time_order(stores: Stores) -> None:
    """Ids made close in time sort close together (herald/ids.py: each index keyed by them
    takes its new entries at one edge), with 74 random bits each, on both stores: the
    fan-out's and a test event's."""
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    started_ms = time.time_ns() // 1_000_000 - 5_000  # the store's clock may be a little behind
    await queue.fan_out([event("j1", 1, "job.running")])
    await queue.fan_out([event("j2", 1, "job.running")])
    made = [row["id"] for row in await deliveries(stores)]
    tested = await webhooks.add_test_delivery("t1", endpoint_id, "evt_test_1", TEST_JOB_PREFIX + "1", b"{}")
    assert tested is not None and len(made) == 2
    ids = [uuid.UUID(text) for text in (*made, tested.id)]
    assert [str(i) for i in ids] == [*made, tested.id], "canonical text, as stored and shown"
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    ended_ms = time.time_ns() // 1_000_000 + 5_000
    assert all(started_ms <= i.int >> 80 <= ended_ms for i in ids), "the time in its first 48 bits"
    assert len({i.int & ((1 << 62) - 1) for i in ids}) == 3, "random bits"


# ----- each tenant's share of a fan-out ---------------------------------------------------------


async def test_a_tenants_events_beyond_its_share_wait_and_are_drained_in_the_order_they_came(stores: Stores) -> None:
    """SPEC §13: one tenant's events add at most ``FAN_OUT_SHARE`` deliveries to a fan-out; the
    rest wait in the store, and so does every later event of that tenant until they are drained,
    while another tenant's events in the same batches are placed at once."""
    webhooks, queue = stores.webhooks, stores.deliveries
    per_event = 8
    busy = [await endpoint(webhooks, url=f"https://busy.example/{n}") for n in range(per_event)]
    quiet = await endpoint(webhooks, tenant="t2", url="https://quiet.example/hook")
    placed_now = FAN_OUT_SHARE // per_event
    batch = [event(f"j{n:03}", 1) for n in range(placed_now + 36)] + [event("q1", 1, tenant="t2")]

    first = await queue.fan_out(batch)
    assert (first.pending, first.waiting) == (placed_now * per_event + 1, 36)
    assert await stores.count("webhook_fan_out_waiting") == 36
    # A tenant with events waiting: its next ones wait behind them, however few; t2's do not.
    second = await queue.fan_out([event("j100", 1), event("q2", 1, tenant="t2")])
    assert (second.pending, second.waiting) == (1, 1)
    assert len(await deliveries(stores, target=quiet)) == 2

    drained = await queue.drain_waiting()
    assert (drained.events, drained.pending) == (37, 37 * per_event)
    assert (await queue.drain_waiting()).events == 0
    assert await stores.count("webhook_fan_out_waiting") == 0
    for target in busy:  # every event of the tenant, each once, in the order they came
        assert [r["job_id"] for r in await deliveries(stores, target=target)] == [
            f"j{n:03}" for n in range(placed_now + 37)]
    # Nothing waits any more: the tenant's next event is placed at once.
    third = await queue.fan_out([event("j101", 1)])
    assert (third.pending, third.waiting) == (per_event, 0)


async def test_a_drain_takes_each_tenant_up_to_its_share_and_the_waiting_tenants_take_turns(stores: Stores) -> None:
    """A pass places at most a share of each tenant's waiting events, for ``DRAIN_TENANTS``
    tenants, the next ones after the last pass's: the waiting tenants take turns, so a tenant
    that spilled once is not queued behind the backlog of those that came before it. Two
    notifiers draining at once place each event once."""
    webhooks, queue = stores.webhooks, stores.deliveries
    tenants = ("t1", "t2", "t3")
    per_event = 64  # a share is 8 such events
    for tenant in tenants:
        for n in range(per_event):
            await endpoint(webhooks, tenant=tenant, url=f"https://{tenant}.example/{n}")
    share_events = FAN_OUT_SHARE // per_event
    for tenant in tenants:
        fanned = await queue.fan_out([event(f"{tenant}-{n:02}", 1, tenant=tenant) for n in range(3 * share_events)])
        assert fanned.waiting == 2 * share_events

    async def one_pass(after: str | None) -> tuple[Any, dict[str, int]]:
        before = Counter(r["tenant"] for r in await deliveries(stores))
        drained = await queue.drain_waiting(after)
        grew = Counter(r["tenant"] for r in await deliveries(stores)) - before
        return drained, {t: n // per_event for t, n in grew.items()}

    first, grew = await one_pass(None)
    assert first.events == DRAIN_TENANTS * share_events and first.last_tenant == "t2"
    assert grew == {"t1": share_events, "t2": share_events}
    second, grew = await one_pass(first.last_tenant)  # t3's turn, then round to t1
    assert grew == {"t3": share_events, "t1": share_events} and second.last_tenant == "t1"
    other = (await stores.another()).deliveries
    passes = await asyncio.gather(*(q.drain_waiting() for q in (queue, other, queue, other)))
    assert all(p.events % share_events == 0 and p.events <= DRAIN_TENANTS * share_events for p in passes)
    while (await queue.drain_waiting()).events:
        pass
    rows = await deliveries(stores)
    assert len(rows) == len({(r["event_id"], r["target"]) for r in rows}) == 3 * 3 * share_events * per_event


async def test_a_waiting_event_that_cannot_be_read_is_dropped_not_a_stop_to_every_drain(stores: Stores) -> None:
    """SQLite keeps a waiting event as the stream carried it (JSON); one that no longer decodes
    (written by another version) is logged and dropped, and the events behind it are placed."""
    if stores.backend != "sqlite":
        pytest.skip("PostgreSQL keeps a waiting event's fields in columns")
    webhooks, queue = stores.webhooks, stores.deliveries
    target = await endpoint(webhooks)
    await stores.sql("INSERT INTO webhook_fan_out_waiting (tenant, event, created_at) VALUES ('t1', $1, 0)",
                     b'{"not": "an event"}')
    fanned = await queue.fan_out([event("j1", 1)])
    assert fanned.waiting == 1  # behind the unreadable one, in order
    assert (await queue.drain_waiting()).events == 2
    assert [r["job_id"] for r in await deliveries(stores, target=target)] == ["j1"]
    assert await stores.count("webhook_fan_out_waiting") == 0


async def test_the_share_rule_is_the_same_in_both_stores(stores: Stores) -> None:
    """PostgreSQL decides the share in plpgsql (``herald_webhook_share_fan_out``), next to the
    data; it must answer as ``delivery_rules.share_fan_out`` does, case by case."""
    rng = random.Random(7)
    cases = [([], [], 10, 40), ([("a", 600)], [], 512, 2048), ([("a", 5), ("a", 5), ("b", 11)], ["b"], 10, 40),
             ([("a", 300), ("b", 300), ("c", 300)], [], 512, 700)]
    for _ in range(300):
        batch = [(rng.choice("abcd"), rng.choice((0, 1, 3, 8, 100))) for _ in range(rng.randint(1, 40))]
        share = rng.choice((1, 8, 100, 512))
        cases.append((batch, rng.sample("abcd", rng.randint(0, 2)), share, share * rng.choice((1, 2, 4))))
    for batch, waiting, share, total in cases:
        expected = share_fan_out(batch, waiting, share, total)
        if stores.backend == "postgres":
            [row] = await stores.sql("SELECT herald_webhook_share_fan_out($1::TEXT[], $2::INTEGER[], $3::TEXT[], $4, $5)"
                                     " AS goes", [t for t, _ in batch], [c for _, c in batch], waiting, share, total)
            assert list(row["goes"]) == expected, (batch, waiting, share, total)
        # Each tenant's events placed now are a first run, within its share (or one event), and
        # all placed now within the batch's room (or one event that makes any).
        placed = [c for (_, c), go in zip(batch, expected) if go]
        assert sum(placed) <= total or len([c for c in placed if c]) == 1
        for tenant in {t for t, _ in batch}:
            mine = [(c, go) for (t, c), go in zip(batch, expected) if t == tenant]
            goes = [go for _, go in mine]
            assert goes == sorted(goes, reverse=True)
            assert tenant not in waiting or not any(goes)
            spent = sum(c for c, go in mine if go)
            assert spent <= share or goes.count(True) == 1


async def test_one_fan_out_adds_at_most_a_batch_whatever_the_number_of_tenants(stores: Stores) -> None:
    """Many tenants each within their share still make one transaction at most
    ``FAN_OUT_BATCH`` deliveries (PostgreSQL locks each job and target it places); the tenants
    past it wait, and the drain places them."""
    webhooks, queue = stores.webhooks, stores.deliveries
    per_event = 100
    tenants = [f"t{n}" for n in range(2 * FAN_OUT_BATCH // per_event)]
    for tenant in tenants:
        for n in range(per_event):
            await endpoint(webhooks, tenant=tenant, url=f"https://{tenant}.example/{n}")
    fanned = await queue.fan_out([event(f"{tenant}-j", 1, tenant=tenant) for tenant in tenants])
    assert fanned.pending == FAN_OUT_BATCH // per_event * per_event
    assert fanned.waiting == len(tenants) - FAN_OUT_BATCH // per_event
    while (await queue.drain_waiting()).events:
        pass
    assert await stores.count("webhook_deliveries") == len(tenants) * per_event


# ----- order per job and target --------------------------------------------------------------


async def test_newer_version_waits_while_an_older_one_is_pending(stores: Stores) -> None:
    queue = stores.deliveries
    await endpoint(stores.webhooks)
    await queue.fan_out([event("j1", 1, "job.running"), event("j1", 2, "job.succeeded")])
    (first,) = await claim(queue)
    assert first.delivery.version == 1
    assert await claim(queue, "n2") == []  # v1 is in flight: v2 must not overtake it
    await finish(stores, first, OK, Plan("delivered"))
    (second,) = await claim(queue)
    assert second.delivery.version == 2


async def test_superseding(stores: Stores) -> None:
    queue = stores.deliveries
    target = await endpoint(stores.webhooks)

    # A failed v1 waiting for its retry is superseded by v2 arriving.
    await queue.fan_out([event("a", 1, "job.running")])
    (a1,) = await claim(queue)
    done = await finish(stores, a1, FAILED, Plan("retry", delay_s=60))
    assert done.status == "pending"
    assert (await queue.fan_out([event("a", 2, "job.succeeded")])).pending == 1
    assert (await deliveries(stores, event_id="evt_a.1"))[0]["status"] == "superseded"
    (a2,) = await claim(queue)
    assert a2.delivery.version == 2

    # A v1 failing after v2 was recorded is superseded instead of retried.
    await queue.fan_out([event("b", 1, "job.running")])
    (b1,) = [c for c in await claim(queue) if c.delivery.job_id == "b"]
    await queue.fan_out([event("b", 2, "job.succeeded")])
    done = await finish(stores, b1, FAILED, Plan("retry", delay_s=60))
    assert (done.status, done.next_attempt_at) == ("superseded", None)

    # An event arriving after a newer one of its job was sent would go back in time: superseded at once.
    await queue.fan_out([event("c", 2, "job.succeeded")])
    (c2,) = [c for c in await claim(queue) if c.delivery.job_id == "c"]
    assert (await queue.fan_out([event("c", 1, "job.running")])).pending == 0
    assert [(r["version"], r["status"]) for r in await deliveries(stores, job_id="c")] == [
        (2, "pending"), (1, "superseded")]
    assert c2.delivery.target == target

    # ... but if the newer one was not sent yet, the older one goes first.
    await queue.fan_out([event("d", 2, "job.succeeded")])
    assert (await queue.fan_out([event("d", 1, "job.running")])).pending == 1
    got = [c for c in await claim(queue, "n3") if c.delivery.job_id == "d"]
    assert [c.delivery.version for c in got] == [1]


async def test_progress_is_throttled_per_job_and_target(stores: Stores) -> None:
    queue = stores.deliveries
    await endpoint(stores.webhooks)
    await queue.fan_out([event("j1", 1, "job.progress")])
    (p1,) = await claim(queue)
    await finish(stores, p1, OK, Plan("delivered"))
    sent_at = p1.delivery.scheduled_at

    await queue.fan_out([event("j1", 2, "job.progress")])
    await queue.fan_out([event("j1", 3, "job.progress")])  # supersedes v2, which was not sent yet
    rows = {r["version"]: r for r in await deliveries(stores, job_id="j1")}
    assert rows[2]["status"] == "superseded"
    assert rows[3]["status"] == "pending"
    assert rows[3]["next_attempt_at"] == pytest.approx(sent_at + PROGRESS_INTERVAL_S)
    assert await claim(queue) == []  # not yet: one per second

    # A state change is not throttled and supersedes the waiting progress.
    assert (await queue.fan_out([event("j1", 4, "job.succeeded")])).pending == 1
    assert (await deliveries(stores, event_id="evt_j1.3"))[0]["status"] == "superseded"
    (last,) = await claim(queue)
    assert last.delivery.version == 4


async def test_order_holds_while_two_notifiers_fan_out_and_claim_concurrently(stores: Stores) -> None:
    """v1 and v2 of each job are fanned out by different notifiers at the same moment, while
    both claim and deliver: no v2 is ever claimed while its v1 can still be sent."""
    await endpoint(stores.webhooks)
    a, b = stores.deliveries, (await stores.another()).deliveries
    jobs = [f"j{n}" for n in range(60)]
    # ("claim", id) once a claim returned, ("finishing", id) before its finish is called, in
    # order. A v2 legally claimed was claimed after v1's finish committed, so after it was
    # called: "finishing v1" comes first. ("Finished" would not do: with two processes, the
    # caller of a later commit can hear back first.)
    log: list[tuple[str, str]] = []
    fanning = True

    async def fan(queue: DeliveryQueue, version: int, order: Sequence[str]) -> None:
        for job in order:
            await queue.fan_out([event(job, version, "job.running" if version == 1 else "job.succeeded")])
            await asyncio.sleep(0)

    async def notifier(queue: DeliveryQueue, owner: str) -> None:
        while True:
            batch = await claim(queue, owner, per_target=1000, limit=5)
            log.extend(("claim", c.delivery.id) for c in batch)
            for item in batch:
                started = await stores.jobs.clock()
                log.append(("finishing", item.delivery.id))
                await queue.finish(item, owner, started, OK, Plan("delivered"))
            if not batch and not fanning and not await queue.anything_due():
                return
            await asyncio.sleep(0)

    workers = [asyncio.create_task(notifier(q, f"n{n}")) for n, q in enumerate([a, b] * 3)]
    # Several fan-outs per side, so that v1 and v2 of a job often meet in flight.
    await asyncio.gather(*(fan(a, 2, jobs[n::3]) for n in range(3)), *(fan(b, 1, jobs[::-1][n::3]) for n in range(3)))
    fanning = False
    await asyncio.gather(*workers)

    position = {(kind, delivery): n for n, (kind, delivery) in enumerate(log)}
    assert len(position) == len(log)  # nothing claimed or finished twice
    for row in await deliveries(stores):
        assert row["status"] in ("delivered", "superseded"), row
    for job in jobs:
        rows = {r["version"]: r for r in await deliveries(stores, job_id=job)}
        assert rows[2]["status"] == "delivered"
        if rows[1]["status"] == "delivered":
            assert position[("finishing", rows[1]["id"])] < position[("claim", rows[2]["id"])], job
        else:
            assert ("claim", rows[1]["id"]) not in position


# ----- claims ------------------------------------------------------------------------------------


async def test_per_target_cap_counts_what_this_notifier_has_in_flight(stores: Stores) -> None:
    queue = stores.deliveries
    busy = await endpoint(stores.webhooks, url="https://busy.example/hook")
    await queue.fan_out([event(f"j{n}", 1) for n in range(5)])
    assert len(await claim(queue, per_target=2)) == 2
    assert len(await claim(queue, "n2", per_target=2, in_flight={busy: 1})) == 1
    assert await claim(queue, "n3", per_target=2, in_flight={busy: 2}) == []
    assert len(await claim(queue, "n4", per_target=2, limit=1)) == 1


async def test_a_target_counted_below_zero_gets_that_much_more_room(stores: Stores) -> None:
    """The notifier's window for a target that keeps up is wider than ``per_target``: it
    counts the target below zero by the difference, and the claim and the leasing fan-out
    give it that much more room."""
    queue = stores.deliveries
    wide = await endpoint(stores.webhooks, url="https://wide.example/hook")
    await queue.fan_out([event(f"j{n}", 1) for n in range(9)])
    assert len(await claim(queue, per_target=2, in_flight={wide: -3})) == 5
    offer = LeaseOffer(owner="n2", lease_s=30.0, per_target=2, limit=100, in_flight={wide: -1})
    result = await queue.fan_out_leasing([event(f"k{n}", 1) for n in range(4)], offer)
    assert result.pending == 4 and len(result.claimed) == 3


async def test_a_tenant_at_its_cap_leaves_a_shared_target_to_the_others(stores: Stores) -> None:
    """SPEC §13: slots go to the tenant with the fewest in flight, at most ``per_tenant`` each.
    A tenant at its cap is passed over: its due deliveries (older ones, to a callback URL
    another tenant uses too) do not take that target's room here."""
    queue = stores.deliveries
    jobs = []
    for tenant in ("noisy", "noisy", "noisy", "quiet"):  # the noisy tenant's are the oldest
        accepted = await stores.jobs.accept(new_job(tenant, callback_url="https://cb.example/shared"))
        jobs.append(accepted.job.id)
    assert (await queue.fan_out([event(j, 2, "job.running", tenant=t)
                                 for j, t in zip(jobs, ("noisy", "noisy", "noisy", "quiet"))])).pending == 4

    async def fair_claim(owner: str, busy: dict[str, int]) -> list[tuple[str, str]]:
        claimed = await queue.claim(owner, lease_s=30.0, per_target=2, limit=10, in_flight={}, per_tenant=1,
                                    tenant_in_flight=busy)
        return [(c.delivery.tenant, c.delivery.job_id) for c in claimed]

    # The noisy tenant has its one slot in flight: the target's two places are the quiet one's.
    assert await fair_claim("n1", {"noisy": 1}) == [("quiet", jobs[3])]
    # With a slot each, each tenant gets one, its oldest.
    assert await fair_claim("n2", {"quiet": 1}) == [("noisy", jobs[0])]


async def test_anything_due_leaves_out_held_targets_but_never_hides_another_behind_a_large_backlog(
        stores: Stores) -> None:
    """A claim leaves the held targets out (their origin is full here, or paced), so the read
    that decides whether a claim is worth it does too: a pass that could lease nothing is not
    made. It reads a bounded number of due rows: past ``DUE_PROBE_ROWS`` it says yes."""
    webhooks, queue = stores.webhooks, stores.deliveries
    busy = await endpoint(webhooks, url="https://busy.example/hook")
    assert not await queue.anything_due() and not await queue.anything_due([busy])
    assert (await queue.fan_out([event(f"b{n}", 1) for n in range(3)])).pending == 3
    assert await queue.anything_due() and not await queue.anything_due([busy])
    other = await endpoint(webhooks, tenant="t2", url="https://other.example/hook")
    assert (await queue.fan_out([event("o1", 1, tenant="t2")])).pending == 1
    assert await queue.anything_due([busy])
    assert [c.delivery.target for c in await claim(queue, held=[busy])] == [other]
    assert not await queue.anything_due([busy])

    # A held backlog of DUE_PROBE_ROWS due rows or more: the read stops and says yes.
    assert (await queue.fan_out([event(f"c{n}", 1) for n in range(DUE_PROBE_ROWS)])).pending == DUE_PROBE_ROWS
    assert await queue.anything_due([busy])


async def test_two_notifiers_claiming_at_once_never_share_a_delivery(stores: Stores) -> None:
    """ports.py, "Exclusive claims"."""
    for n in range(20):
        await endpoint(stores.webhooks, url=f"https://{n}.example/hook")
    notifiers = [stores.deliveries, (await stores.another()).deliveries]
    assert (await notifiers[0].fan_out([event(f"j{n}", 1) for n in range(10)])).pending == 200

    async def claimer(queue: DeliveryQueue, owner: str) -> list[str]:
        got: list[str] = []
        while batch := await claim(queue, owner, per_target=100, limit=7):
            got += [c.delivery.id for c in batch]
        return got

    results = await asyncio.gather(*(claimer(notifiers[n % 2], f"n{n % 2}") for n in range(8)))
    claimed = list(itertools.chain.from_iterable(results))
    assert len(claimed) == len(set(claimed)) == 200
    assert all(results[0::2]) and all(results[1::2])  # both notifiers got work
    rows = await deliveries(stores)
    assert {r["id"] for r in rows} == set(claimed)
    assert all(r["lease_owner"] in ("n0", "n1") and r["lease_until"] is not None for r in rows)
    assert not await notifiers[1].anything_due()


async def test_leases_release_and_expiry(stores: Stores) -> None:
    queue = stores.deliveries
    await endpoint(stores.webhooks)
    other = (await stores.another()).deliveries
    await queue.fan_out([event("j1", 1), event("j2", 1)])
    held = await claim(queue, "n1")
    assert len(held) == 2 and await claim(other, "n2") == []

    await queue.release([held[0].delivery.id], "someone-else")  # only the holder can release
    assert await claim(other, "n2") == []
    await queue.release([held[0].delivery.id], "n1")
    (taken,) = await claim(other, "n2")
    assert taken.delivery.id == held[0].delivery.id
    assert taken.delivery.lease_owner == "n2"  # the row as leased
    assert taken.delivery.lease_until is not None and taken.delivery.lease_until > await stores.jobs.clock()

    # A killed notifier's lease runs out on the store's clock; its late finish changes nothing.
    await stores.sql("UPDATE webhook_deliveries SET lease_until = $2 WHERE id = $1",
                     held[1].delivery.id, await stores.jobs.clock() - 1)
    (recovered,) = await claim(other, "n2")
    assert recovered.delivery.id == held[1].delivery.id
    await finish(stores, held[1], OK, Plan("delivered"), owner="n1")
    (row,) = await deliveries(stores, id=held[1].delivery.id)
    assert (row["status"], row["lease_owner"]) == ("pending", "n2")


async def test_a_lease_is_renewed_only_by_its_holder_and_only_while_pending(stores: Stores) -> None:
    """A live notifier renews the leases of its attempts in flight (notifier.scheduler.RENEW_EVERY_S),
    so a lease need not outlast an attempt; a lease that ran out and was taken is the taker's."""
    queue = stores.deliveries
    await endpoint(stores.webhooks)
    other = (await stores.another()).deliveries
    await queue.fan_out([event("j1", 1), event("j2", 1)])
    held = await claim(queue, "n1", lease_s=5.0)
    ids = [h.delivery.id for h in held]

    async def lease_until(delivery_id: str) -> float:
        (row,) = await deliveries(stores, id=delivery_id)
        return float(row["lease_until"])

    before = await lease_until(ids[0])
    await queue.renew(ids, "someone-else", 600.0)
    assert await lease_until(ids[0]) == before
    await queue.renew(ids, "n1", 600.0)
    assert await lease_until(ids[0]) >= await stores.jobs.clock() + 590
    # Ran out and taken by n2: n1's renewal (a notifier that stalled) leaves n2's lease alone.
    await stores.sql("UPDATE webhook_deliveries SET lease_until = $2 WHERE id = $1", ids[1], await stores.jobs.clock() - 1)
    (taken,) = await claim(other, "n2")
    assert taken.delivery.id == ids[1]
    await queue.renew(ids, "n1", 600.0)
    (row,) = await deliveries(stores, id=ids[1])
    assert row["lease_owner"] == "n2" and float(row["lease_until"]) < await stores.jobs.clock() + 590
    # A settled delivery keeps no lease.
    await finish(stores, held[0], OK, Plan("delivered"), owner="n1")
    await queue.renew(ids, "n1", 600.0)
    (row,) = await deliveries(stores, id=ids[0])
    assert (row["status"], row["lease_owner"], row["lease_until"]) == ("delivered", None, None)


async def test_a_claim_is_fair_among_tenants_and_keeps_their_caps(stores: Stores) -> None:
    """ports.py, ``claim``: the slots go to the tenant with the fewest in flight first, within a
    tenant round robin over its targets, oldest first only among equals; ``per_tenant`` caps
    what a tenant has in flight, and ``held`` targets get nothing."""
    webhooks, queue = stores.webhooks, stores.deliveries
    a1 = await endpoint(webhooks, "a", url="https://a1.example/hook")
    a2 = await endpoint(webhooks, "a", url="https://a2.example/hook")
    b1 = await endpoint(webhooks, "b", url="https://b1.example/hook")
    assert (await queue.fan_out([event(f"a-{n}", 1, tenant="a") for n in range(3)])).pending == 6  # a's backlog: older
    assert (await queue.fan_out([event("b-0", 1, tenant="b")])).pending == 1

    async def targets(**options: object) -> list[str]:
        claimed = await claim(queue, **options)  # type: ignore[arg-type]
        await queue.release([c.delivery.id for c in claimed], "n1")
        return sorted(c.delivery.target for c in claimed)

    # a's oldest, b's one, then a's other target: b does not wait behind a's backlog.
    assert await targets(limit=3) == sorted([a1, a2, b1])
    assert await targets(limit=1, tenant_in_flight={"a": 2}) == [b1]  # the fewest in flight first
    capped = await targets(limit=10, per_tenant=2, tenant_in_flight={"a": 1})  # one slot left for a, two for b
    assert len(capped) == 2 and b1 in capped and len(set(capped) & {a1, a2}) == 1
    assert await targets(limit=10, per_tenant=1, tenant_in_flight={"a": 1, "b": 1}) == []
    assert await targets(limit=10, held={a1, b1}) == [a2] * 3
    assert len(await targets(limit=10, per_tenant=0)) == 7  # 0: no cap


def _fair_share(pending: Sequence[dict[str, Any]], *, per_target: int, limit: int, in_flight: dict[str, int],
                per_tenant: int, tenant_in_flight: dict[str, int], held: Collection[str]) -> list[str]:
    """The ids a claim leases, in order, restated from ``DeliveryQueue.claim`` (ports.py) and
    SPEC §13 for deliveries that are all due and none of them behind an older version: a
    tenant at its cap gets nothing, nor does a held target; a target's room (``per_target``
    less what it has in flight) goes to its oldest deliveries over every tenant sending to
    it; within a tenant, round robin over its targets (rank in its target first), at most its
    cap less what it has in flight; across tenants, slot k of a tenant with n in flight sorts
    at n + k, then oldest first; ``limit`` in all."""
    def age(row: dict[str, Any]) -> tuple[float, int]:
        return row["next_attempt_at"], row["seq"]

    def room(target: str) -> int:
        return max(per_target - in_flight.get(target, 0), 0)

    by_target: dict[str, list[dict[str, Any]]] = {}
    for tenant_and_target, rows in itertools.groupby(
            sorted(pending, key=lambda r: (r["tenant"], r["target"], *age(r))), key=lambda r: (r["tenant"], r["target"])):
        tenant, target = tenant_and_target
        if target in held or (per_tenant > 0 and tenant_in_flight.get(tenant, 0) >= per_tenant):
            continue
        by_target.setdefault(target, []).extend(list(rows)[:room(target)])
    by_tenant: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for target, rows in by_target.items():
        for rank, row in enumerate(sorted(rows, key=age)[:room(target)], start=1):
            by_tenant.setdefault(row["tenant"], []).append((rank, row))
    slots: list[tuple[int, float, int, str]] = []
    for tenant, ranked in by_tenant.items():
        held_now = tenant_in_flight.get(tenant, 0)
        for k, (_rank, row) in enumerate(sorted(ranked, key=lambda c: (c[0], *age(c[1]))), start=1):
            if per_tenant > 0 and held_now + k > per_tenant:
                break
            slots.append((held_now + k, *age(row), row["id"]))
    return [slot[3] for slot in sorted(slots)[:limit]]


async def test_a_claim_leases_what_fair_share_says_for_any_backlog_and_counts(stores: Stores) -> None:
    """Random backlogs (three tenants, an endpoint per kind each, callback URLs two tenants
    share) and random offers (room per target, counts in flight below and above it, caps per
    tenant, held targets, limits): each claim leases exactly the deliveries, in the order,
    that ``_fair_share`` restates from the port's contract. The claim is then handed back,
    so every offer sees the same backlog."""
    rnd = random.Random(13)
    webhooks, queue = stores.webhooks, stores.deliveries
    tenants = ("a", "b", "c")
    for tenant in tenants:
        for kind in ("echo", "pdf"):
            await endpoint(webhooks, tenant, url=f"https://{tenant}-{kind}.example/hook",
                           event_types=["job.succeeded"], kinds=[kind])
    callbacks = ("https://one.example/cb", "https://two.example/cb", None)
    events = []
    for _ in range(48):
        tenant = rnd.choice(tenants)
        job = await stores.jobs.accept(new_job(tenant, callback_url=rnd.choice(callbacks)))
        events.append(event(job.job.id, 1, tenant=tenant, kind=rnd.choice(("echo", "pdf"))))
    for first in range(0, len(events), 12):  # four fan-outs: four due times
        await queue.fan_out(events[first:first + 12])
    pending = await deliveries(stores, status="pending")
    targets = sorted({row["target"] for row in pending})
    assert len(pending) > 48 and any(t.startswith(CALLBACK_PREFIX) for t in targets)

    for n in range(40):
        offer: dict[str, Any] = {
            "per_target": rnd.choice((1, 2, 3, 10)),
            "limit": rnd.choice((1, 3, 7, 100)),
            "in_flight": {t: rnd.randint(-2, 3) for t in rnd.sample(targets, rnd.randint(0, len(targets)))},
            "per_tenant": rnd.choice((0, 1, 2, 5)),
            "tenant_in_flight": {t: rnd.randint(0, 3) for t in rnd.sample(tenants, rnd.randint(0, 3))},
            "held": set(rnd.sample(targets, rnd.randint(0, 2))),
        }
        claimed = await claim(queue, f"n{n}", **offer)
        assert [c.delivery.id for c in claimed] == _fair_share(pending, **offer), offer
        await queue.release([c.delivery.id for c in claimed], f"n{n}")


async def test_a_claim_carries_its_jobs_trace_context(stores: Stores) -> None:
    """``Claimed.trace_context``: the job's kept context, read with the claim; None without one."""
    await endpoint(stores.webhooks)
    traced = new_job()
    traced = NewJob(**{**{f: getattr(traced, f) for f in traced.__dataclass_fields__},
                       "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                       "tracestate": "vendor=1"})
    events = [(await stores.jobs.accept(job)).event for job in (traced, new_job())]
    assert (await stores.deliveries.fan_out([e for e in events if e is not None])).pending == 2
    contexts = {c.delivery.job_id: c.trace_context for c in await claim(stores.deliveries)}
    assert contexts == {traced.id: ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "vendor=1"),
                        next(j for j in contexts if j != traced.id): None}


async def test_defer_hands_deliveries_back_later_without_an_attempt(stores: Stores) -> None:
    """ports.py, ``defer`` (a paced target): the leased ones come back due in ``delay_s``, and
    every due, unleased pending delivery of the target moves to then as well; nothing is
    counted as an attempt, and other targets keep their times."""
    webhooks, queue = stores.webhooks, stores.deliveries
    paced = await endpoint(webhooks, url="https://paced.example/hook")
    other = await endpoint(webhooks, url="https://other.example/hook")
    await queue.fan_out([event(f"j{n}", 1) for n in range(3)])
    [held] = [c for c in await claim(queue, per_target=1) if c.delivery.target == paced]
    before = await stores.jobs.clock()
    await queue.defer([held.delivery.id], "someone-else", [], 60.0)  # only the holder hands it back
    [row] = await deliveries(stores, id=held.delivery.id)
    assert row["lease_owner"] is not None
    await queue.defer([held.delivery.id], "n1", [paced], 60.0)
    after = await stores.jobs.clock()
    rows = await deliveries(stores, target=paced)
    assert len(rows) == 3 and all(r["attempts"] == 0 and r["lease_owner"] is None for r in rows)
    assert all(before + 60.0 <= r["next_attempt_at"] <= after + 60.0 for r in rows), rows
    assert await stores.count("webhook_attempts") == 0
    assert {c.delivery.target for c in await claim(queue, "n2")} == {other}  # the paced target is not due
    assert await queue.next_due_after(after) == pytest.approx(min(r["next_attempt_at"] for r in rows))


def _leased(items: Sequence[Claimed]) -> set[tuple[str, str]]:
    return {(c.delivery.target, c.delivery.event_id) for c in items}


async def test_a_fan_out_that_leases_takes_what_a_claim_would_and_the_claim_finds_the_rest(stores: Stores) -> None:
    """``fan_out_leasing``: what it leases is what the claim would have leased (the first pending
    version per job and target, each once, to the offer's owner, ready to send); the claim after
    it finds the rest."""
    webhooks, queue = stores.webhooks, stores.deliveries
    hook = await endpoint(webhooks)
    await stores.jobs.accept(new_job(job_id="j1", callback_url="https://cb.example/done"))
    callback = CALLBACK_PREFIX + "https://cb.example/done"
    offer = LeaseOffer(owner="n1", lease_s=30.0, per_target=10, limit=100, in_flight={})
    result = await queue.fan_out_leasing(
        [event("j1", 1, "job.running"), event("j1", 2, "job.succeeded"), event("j2", 1)], offer)
    assert result.pending == 5  # j1.1 and j1.2 to the endpoint and the callback, j2.1 to the endpoint
    first = {(hook, "evt_j1.1"), (callback, "evt_j1.1"), (hook, "evt_j2.1")}
    leased = _leased(result.claimed)
    rest = _leased(await claim(queue, "n2"))
    assert leased == first and not rest  # j1.2 waits behind j1.1 at both targets
    for item in result.claimed:
        assert item.delivery.lease_owner == "n1" and item.keys and item.body
        assert item.url == ("https://cb.example/done" if item.delivery.target == callback else "https://example.com/hook")
    assert await queue.fan_out_leasing([event("j1", 2, "job.succeeded")], offer) == FannedOut(0)  # already there


async def test_a_fan_out_leases_within_the_claims_caps(stores: Stores) -> None:
    """The offer's caps hold as the claim's do: slots per target (with what is in flight), per
    tenant, the held targets, the limit."""
    webhooks, queue = stores.webhooks, stores.deliveries
    a = await endpoint(webhooks, tenant="a")
    b = await endpoint(webhooks, tenant="b")

    async def lease(batch: str, **caps: Any) -> Counter[str]:
        offer = LeaseOffer(**{"owner": "n1", "lease_s": 30.0, "per_target": 10, "limit": 100, "in_flight": {}, **caps})
        events = [event(f"{batch}{tenant}{n}", 1, tenant=tenant) for tenant in ("a", "b") for n in range(3)]
        result = await queue.fan_out_leasing(events, offer)
        assert result.pending == 6
        await claim(queue, "n9")  # what it left is out of the next case's way
        return Counter(item.delivery.target for item in result.claimed)

    caps: list[tuple[dict[str, Any], dict[str, int]]] = [
        ({"per_target": 2, "in_flight": {a: 1}}, {a: 1, b: 2}),
        ({"per_tenant": 2, "tenant_in_flight": {"a": 2, "b": 1}}, {b: 1}),
        ({"held": [a]}, {b: 3}),
        ({"limit": 0}, {}),
        ({"limit": 2}, {a: 1, b: 1}),  # the fewest in flight first: one each
    ]
    for n, (given, expected) in enumerate(caps):
        got = await lease(f"c{n}", **given)
        assert got == expected, given


async def test_a_fan_out_leases_only_among_the_targets_its_batch_touched(stores: Stores) -> None:
    """Another tenant's due backlog is the claim pass's, not a fan-out's: a quiet tenant's batch
    leases its own deliveries and never waits on a walk of the noisy one's (SPEC §13)."""
    webhooks, queue = stores.webhooks, stores.deliveries
    noisy = await endpoint(webhooks, tenant="a")
    quiet = await endpoint(webhooks, tenant="b")
    await queue.fan_out([event(f"a{n}", 1, tenant="a") for n in range(3)])  # due, nobody holds them
    offer = LeaseOffer(owner="n1", lease_s=30.0, per_target=10, limit=100, in_flight={})
    result = await queue.fan_out_leasing([event("b1", 1, tenant="b")], offer)
    assert result.pending == 1 and [item.delivery.target for item in result.claimed] == [quiet]
    assert Counter(item.delivery.target for item in await claim(queue, "n2")) == {noisy: 3}


async def test_a_fan_out_leases_for_each_tenant_of_a_callback_url_they_share(stores: Stores) -> None:
    queue = stores.deliveries
    jobs = {}
    for tenant in ("x", "y"):
        accepted = await stores.jobs.accept(new_job(tenant, callback_url="https://cb.example/shared"))
        jobs[tenant] = accepted.job.id
    offer = LeaseOffer(owner="n1", lease_s=30.0, per_target=10, limit=100, in_flight={})
    result = await queue.fan_out_leasing([event(j, 2, "job.running", tenant=t) for t, j in jobs.items()], offer)
    assert result.pending == 2 and sorted(item.delivery.tenant for item in result.claimed) == ["x", "y"]


# ----- outcomes ----------------------------------------------------------------------------------


async def test_retry_is_scheduled_by_the_stores_clock(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1)])
    (item,) = await claim(queue)
    before = await stores.jobs.clock()
    done = await finish(stores, item, FAILED, Plan("retry", delay_s=30))
    after = await stores.jobs.clock()
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
    await stores.sql("UPDATE webhook_deliveries SET next_attempt_at = next_attempt_at - 31")
    (again,) = await claim(queue)
    assert again.delivery.id == item.delivery.id and again.delivery.attempts == 1
    done = await finish(stores, again, OK, Plan("delivered"))
    assert (done.status, done.next_attempt_at) == ("delivered", None)
    assert [a.n for a in (await webhooks.attempts([row.id]))[row.id]] == [1, 2]
    endpoint_row = await webhooks.get_endpoint("t1", endpoint_id)
    assert endpoint_row is not None and endpoint_row.failing_since is None  # healthy again


async def test_410_disables_the_endpoint_and_fails_its_pending(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    gone = await endpoint(webhooks, url="https://gone.example/hook")
    fine = await endpoint(webhooks, url="https://fine.example/hook")
    await queue.fan_out([event(f"j{n}", 1) for n in range(3)])
    item = next(c for c in await claim(queue, per_target=1) if c.delivery.endpoint_id == gone)
    done = await finish(stores, item, GONE, Plan("failed", disable_endpoint=True))
    assert (done.status, done.endpoint_disabled) == ("failed", True)
    endpoint_row = await webhooks.get_endpoint("t1", gone)
    assert endpoint_row is not None and endpoint_row.status == "disabled"
    rows = await deliveries(stores, endpoint_id=gone)
    assert sorted(r["status"] for r in rows) == ["failed"] * 3
    attempted = next(r for r in rows if r["id"] == item.delivery.id)
    assert attempted["attempts"] == 1  # the attempt that disabled it is counted
    assert {r["status"] for r in await deliveries(stores, endpoint_id=fine)} == {"pending"}


async def test_disabling_an_endpoint_leaves_its_attempts_in_flight_to_settle(stores: Stores) -> None:
    """Disabling fails the deliveries that wait; one being sent is settled by its attempt: a 2xx
    delivers it (attempts 1), a failure fails it at once, not retried. Failing it at the
    disable took its lease, so its attempt was logged and its 2xx left it failed, attempts 0."""
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1), event("j2", 1), event("j3", 1)])
    sent = {c.delivery.job_id: c for c in await claim(queue, per_target=2)}
    assert set(sent) == {"j1", "j2"}
    disabled = await webhooks.update_endpoint("t1", endpoint_id, {"status": "disabled"})
    assert disabled is not None and disabled.status == "disabled"
    [waiting] = await deliveries(stores, job_id="j3")
    assert (waiting["status"], waiting["attempts"]) == ("failed", 0)  # waited: failed, never sent

    done = await finish(stores, sent["j1"], OK, Plan("delivered"))
    assert (done.status, done.endpoint_disabled) == ("delivered", False)
    [row] = await deliveries(stores, job_id="j1")
    assert (row["status"], row["attempts"], row["lease_owner"]) == ("delivered", 1, None)
    done = await finish(stores, sent["j2"], FAILED, Plan("retry", delay_s=10))
    assert (done.status, done.next_attempt_at, done.endpoint_disabled) == ("failed", None, True)
    [row] = await deliveries(stores, job_id="j2")
    assert (row["status"], row["attempts"], row["next_attempt_at"]) == ("failed", 1, None)
    assert (await webhooks.get_endpoint("t1", endpoint_id)).status == "disabled"  # type: ignore[union-attr]


async def test_a_410_leaves_the_endpoints_other_attempt_in_flight_to_settle(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1), event("j2", 1), event("j3", 1)])
    sent = {c.delivery.job_id: c for c in await claim(queue, per_target=2)}
    done = await finish(stores, sent["j1"], GONE, Plan("failed", disable_endpoint=True))
    assert (done.status, done.endpoint_disabled) == ("failed", True)
    assert [(r["job_id"], r["status"]) for r in await deliveries(stores)] == [
        ("j1", "failed"), ("j2", "pending"), ("j3", "failed")]
    # as the notifier records it, in a batch (the set-based path for 2xx answers)
    attempt = Attempted(claimed=sent["j2"], started_at=await stores.jobs.clock(), outcome=OK, plan=Plan("delivered"))
    [done] = await stores.deliveries.finish_many([attempt], "n1")
    assert done.status == "delivered"
    [row] = await deliveries(stores, job_id="j2")
    assert (row["status"], row["attempts"]) == ("delivered", 1)


async def test_a_disabled_endpoints_delivery_whose_attempt_was_never_recorded_fails_at_the_prune(
        stores: Stores) -> None:
    """A delivery out when its endpoint was disabled, whose notifier then died (its lease ran out)
    or handed it back unsent: nothing will send it, so the notifier's prune fails it, as
    disabling would have. One still out is left to its attempt."""
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1), event("j2", 1), event("j3", 1)])
    sent = {c.delivery.job_id: c for c in await claim(queue, per_target=3)}
    await webhooks.update_endpoint("t1", endpoint_id, {"status": "disabled"})
    await stores.sql("UPDATE webhook_deliveries SET lease_until = lease_until - 60 WHERE job_id = 'j1'")
    await queue.release([sent["j2"].delivery.id], "n1")
    assert [r["status"] for r in await deliveries(stores)] == ["pending"] * 3
    await queue.prune(0.0)
    assert [(r["job_id"], r["status"], r["attempts"]) for r in await deliveries(stores)] == [
        ("j1", "failed", 0), ("j2", "failed", 0), ("j3", "pending", 0)]
    done = await finish(stores, sent["j3"], OK, Plan("delivered"))
    assert done.status == "delivered"


async def test_an_endpoint_failing_for_five_days_is_disabled(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_row, _key = await webhooks.create_endpoint("acme", url="https://hooks.example.com/x",
                                                        event_types=["job.queued"], kinds=None, signature="ed25519")
    assert (await queue.fan_out(await _two_jobs(stores.jobs))).pending == 2
    await stores.sql("UPDATE webhook_endpoints SET failing_since = $2 WHERE id = $1",
                     endpoint_row.id, await stores.jobs.clock() - ENDPOINT_DISABLE_AFTER_S - 1)
    claimed = await queue.claim("test", lease_s=30, per_target=1, limit=10, in_flight={})
    assert len(claimed) == 1  # one slot per target here
    assert claimed[0].keys and claimed[0].keys[0].algorithm == "ed25519"
    finished = await finish(stores, claimed[0], FAILED, Plan("retry", delay_s=10), owner="test")
    assert (finished.status, finished.next_attempt_at, finished.endpoint_disabled) == ("failed", None, True)
    assert (await webhooks.get_endpoint("acme", endpoint_row.id)).status == "disabled"  # type: ignore[union-attr]
    rows = await webhooks.list_deliveries(endpoint_row.id, status=None, before_seq=None, limit=10)
    assert [r.status for r in rows] == ["failed", "failed"]  # the waiting one too: dropped, not queued
    assert {r["status"] for r in await deliveries(stores)} == {"failed"}
    assert [a.status_code for a in (await webhooks.attempts([claimed[0].delivery.id]))[claimed[0].delivery.id]] == [500]
    assert await queue.claim("test", lease_s=30, per_target=1, limit=10, in_flight={}) == []


async def test_enabling_an_enabled_endpoint_keeps_its_failing_streak(stores: Stores) -> None:
    """``PATCH {"status": "enabled"}`` of an endpoint already enabled (a config sync sending the
    whole endpoint) changes nothing: its 5-day failing streak goes on. Only re-enabling a
    disabled endpoint is a fresh start."""
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    since = await stores.jobs.clock() - ENDPOINT_DISABLE_AFTER_S - 1
    await stores.sql("UPDATE webhook_endpoints SET failing_since = $2 WHERE id = $1", endpoint_id, since)
    for changes in ({"status": "enabled"}, {"url": "https://example.com/hook2", "status": "enabled"}):
        row = await webhooks.update_endpoint("t1", endpoint_id, changes)
        assert row is not None and row.status == "enabled" and row.failing_since == pytest.approx(since)
    await queue.fan_out([event("j1", 1)])
    (item,) = await claim(queue)
    done = await finish(stores, item, FAILED, Plan("retry", delay_s=10))
    assert (done.status, done.endpoint_disabled) == ("failed", True)  # five days of failing, as promised

    row = await webhooks.update_endpoint("t1", endpoint_id, {"status": "enabled"})
    assert row is not None and row.status == "enabled" and row.failing_since is None  # re-enabled: a fresh start


async def test_finish_after_the_endpoint_was_deleted_is_dropped(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1)])
    (item,) = await claim(queue)
    assert await webhooks.delete_endpoint("t1", endpoint_id)
    done = await finish(stores, item, OK, Plan("delivered"))
    assert done.status == "dropped"
    assert await stores.count("webhook_attempts") == 0


async def test_deleting_an_endpoint_with_a_long_log_leaves_nothing_and_never_holds_other_tenants(
        stores: Stores) -> None:
    """An endpoint whose target is paced keeps its deliveries pending: its log grows long.
    Deleting it removes every delivery and attempt; meanwhile another tenant's start goes
    through (on SQLite, whose one writer serves every tenant, the log goes a batch at a time)."""
    webhooks, queue = stores.webhooks, stores.deliveries
    doomed = await endpoint(webhooks)
    kept = await endpoint(webhooks, url="https://example.com/kept")
    for n in range(0, 3000, 500):
        await queue.fan_out([event(f"j{m}", 1) for m in range(n, n + 500)])
    while (await queue.drain_waiting()).events:  # beyond the tenant's share of each fan-out
        pass
    items = await claim(queue, per_target=4, limit=8)
    await finish(stores, items[0], OK, Plan("delivered"))
    deleting = asyncio.create_task(webhooks.delete_endpoint("t1", doomed))
    await asyncio.sleep(0)  # its first write is under way
    accepted = await stores.jobs.accept(new_job("t2"))
    if stores.backend == "sqlite":
        assert not deleting.done(), "another tenant's start waited for the whole delete"
    assert accepted.job.tenant == "t2" and await deleting
    assert await stores.count("webhook_deliveries") == 3000  # the other endpoint's, all there
    assert not await webhooks.delete_endpoint("t1", doomed)
    assert {item.delivery.target for item in await claim(queue, "n2")} == {kept}


THANKED = Outcome(status_code=200, latency_s=0.012, response=b"thanks")
BOOM = Outcome(status_code=500, latency_s=0.02, error=None, response=b"boom")
CONNECTION_REFUSED = Outcome(status_code=None, latency_s=0.003, error="ClientConnectorError: refused")
RETRY_IN_S = 300.0


def _typed_event(job_id: str, type: str) -> JobEvent:
    return JobEvent(seq=1, tenant="t1", job_id=job_id, kind="report", version=1, type=type,
                    at="2026-01-01T00:00:00Z", data=msgspec.Raw(msgspec.json.encode({"id": job_id, "version": 1})))


async def test_many_attempts_recorded_in_one_batch(stores: Stores) -> None:
    """Deliveries to several endpoints finishing together, each with its own outcome, are all
    recorded by one ``finish_many`` (issue 14): attempt rows, statuses, retries, leases,
    endpoint health."""
    webhooks, queue = stores.webhooks, stores.deliveries

    async def add(path: str, types: list[str]) -> str:
        row, _ = await webhooks.create_endpoint("t1", url=f"https://hooks.example.com/{path}", event_types=types,
                                                kinds=None, signature="hmac-sha256")
        return row.id

    ok_a, ok_b, failing, refusing = [await add(p, ["job.succeeded"]) for p in ("a", "b", "c", "r")]
    gone = await add("g", ["job.failed"])
    deleted = await add("d", ["job.succeeded"])
    jobs = [f"job-{n}" for n in range(5)]
    events = [_typed_event(j, "job.succeeded") for j in jobs] + [_typed_event("job-x", "job.failed")]
    assert (await queue.fan_out(events)).pending == 5 * 5 + 1
    claimed = await queue.claim("n1", lease_s=30, per_target=10, limit=100, in_flight={})
    assert len(claimed) == 26
    await webhooks.delete_endpoint("t1", deleted)  # while its attempts were in flight

    def decide(item: Claimed) -> tuple[Outcome, Plan]:
        d = item.delivery
        if d.endpoint_id == failing:  # two will be retried, three have used up their schedule
            return BOOM, Plan("retry", delay_s=RETRY_IN_S) if d.job_id in jobs[:2] else Plan("failed")
        if d.endpoint_id == refusing:
            return CONNECTION_REFUSED, Plan("retry", delay_s=RETRY_IN_S)
        if d.endpoint_id == gone:
            return GONE, Plan("failed", disable_endpoint=True)
        return THANKED, Plan("delivered")

    started = time.time()
    attempts = [Attempted(claimed=item, started_at=started, outcome=decide(item)[0], plan=decide(item)[1])
                for item in claimed]
    finished = await queue.finish_many(attempts, "n1")
    assert len(finished) == len(attempts)
    for attempt, result in zip(attempts, finished, strict=True):  # in the order given
        d = attempt.claimed.delivery
        expected = {ok_a: "delivered", ok_b: "delivered", gone: "failed", deleted: "dropped",
                    refusing: "pending"}.get(d.endpoint_id or "")
        if d.endpoint_id == failing:
            expected = "pending" if d.job_id in jobs[:2] else "failed"
        assert result.status == expected, (d.endpoint_id, d.job_id, result)
        assert result.endpoint_disabled == (d.endpoint_id == gone)
        assert (result.next_attempt_at is not None) == (expected == "pending")
        if result.next_attempt_at is not None:
            assert result.next_attempt_at >= started + RETRY_IN_S - 5

    # Durably there, as the portal and /webhooks/{id}/deliveries read them.
    for endpoint_id, statuses, code, response, error in (
        (ok_a, ["delivered"] * 5, 200, b"thanks", None),
        (ok_b, ["delivered"] * 5, 200, b"thanks", None),
        (failing, ["failed"] * 3 + ["pending"] * 2, 500, b"boom", None),
        (refusing, ["pending"] * 5, None, None, CONNECTION_REFUSED.error),
        (gone, ["failed"], 410, None, None),
    ):
        rows = await webhooks.list_deliveries(endpoint_id, status=None, before_seq=None, limit=100)
        assert sorted(r.status for r in rows) == sorted(statuses), endpoint_id
        assert all(r.lease_owner is None and r.lease_until is None for r in rows)
        assert all(r.attempts == 1 for r in rows)
        logged = await webhooks.attempts([r.id for r in rows])
        for r in rows:
            [attempt] = logged[r.id]
            assert (attempt.n, attempt.status_code, attempt.error) == (1, code, error)
            assert (bytes(attempt.response) if attempt.response is not None else None) == response
            assert attempt.latency_ms is not None and attempt.latency_ms > 0
            assert abs(attempt.at - started) < 1e-3
    assert await webhooks.list_deliveries(deleted, status=None, before_seq=None, limit=100) == []
    assert (await webhooks.get_endpoint("t1", gone)).status == "disabled"  # type: ignore[union-attr]
    health = await webhooks.get_endpoint("t1", failing)
    assert health is not None and health.status == "enabled" and health.failing_since is not None
    healthy = await webhooks.get_endpoint("t1", ok_a)
    assert healthy is not None and healthy.failing_since is None

    # Every lease was released with its outcome: the retries are not due yet, nothing is held.
    assert await queue.claim("n2", lease_s=30, per_target=10, limit=100, in_flight={}) == []
    assert await queue.finish_many([], "n1") == []

    # A second round for the retried ones, recorded the same way: attempt 2 after attempt 1.
    for item in claimed:
        if item.delivery.endpoint_id == failing and item.delivery.job_id in jobs[:2]:
            await webhooks.retry_now(failing, item.delivery.id)
    again = await queue.claim("n1", lease_s=30, per_target=10, limit=100, in_flight={})
    assert sorted(c.delivery.job_id for c in again) == jobs[:2]
    done = await queue.finish_many([Attempted(claimed=c, started_at=time.time(), outcome=THANKED, plan=Plan("delivered"))
                                    for c in again], "n1")
    assert [f.status for f in done] == ["delivered", "delivered"]
    logged = await webhooks.attempts([c.delivery.id for c in again])
    assert all([a.status_code for a in logged[c.delivery.id]] == [500, 200] for c in again)
    health = await webhooks.get_endpoint("t1", failing)
    assert health is not None and health.failing_since is None  # a success ends the failing streak


async def test_an_attempt_recorded_again_is_recorded_once(stores: Stores) -> None:
    """The notifier records an attempt again when the answer to its record was lost (a
    connection cut after the commit); the store that already holds that attempt (its
    ``Attempted.id``) writes nothing and answers the delivery as the first record left it, so
    the delivery's history shows each POST once. In a batch or alone, delivered (the bulk path),
    retried or failing its endpoint (one by one)."""
    webhooks, queue = stores.webhooks, stores.deliveries

    async def add(path: str, types: list[str]) -> str:
        row, _ = await webhooks.create_endpoint("t1", url=f"https://hooks.example.com/{path}", event_types=types,
                                                kinds=None, signature="hmac-sha256")
        return row.id

    thanking, failing = await add("ok", ["job.succeeded"]), await add("boom", ["job.succeeded"])
    gone = await add("gone", ["job.failed"])
    events = [_typed_event(f"job-{n}", "job.succeeded") for n in range(2)] + [_typed_event("job-x", "job.failed")]
    await queue.fan_out(events)
    claimed = await queue.claim("n1", lease_s=30, per_target=10, limit=100, in_flight={})
    assert len(claimed) == 5

    def attempted(item: Claimed) -> Attempted:
        outcome, plan = {thanking: (THANKED, Plan("delivered")), failing: (BOOM, Plan("retry", delay_s=RETRY_IN_S)),
                         gone: (GONE, Plan("failed", disable_endpoint=True))}[item.delivery.endpoint_id or ""]
        return Attempted(claimed=item, started_at=time.time(), outcome=outcome, plan=plan)

    attempts = [attempted(item) for item in claimed]
    first = await queue.finish_many(attempts, "n1")
    assert sorted(f.status for f in first) == ["delivered", "delivered", "failed", "pending", "pending"]
    assert await queue.finish_many(attempts, "n1") == first  # the whole batch again
    for attempt, answer in zip(attempts, first, strict=True):  # and each alone, as the recorder's fallback does
        assert await queue.finish_many([attempt], "n1") == [answer]

    logged = await webhooks.attempts([item.delivery.id for item in claimed])
    assert {d: [a.n for a in rows] for d, rows in logged.items()} == {item.delivery.id: [1] for item in claimed}
    assert await stores.count("webhook_attempts") == 5
    rows = {r["id"]: r for r in await deliveries(stores)}
    assert all(rows[item.delivery.id]["attempts"] == 1 for item in claimed)
    # A delivery retried later is a new attempt, with an id of its own: logged as the second.
    retried = next(item for item in claimed if item.delivery.endpoint_id == failing)
    await webhooks.retry_now(failing, retried.delivery.id)
    [again] = await queue.claim("n1", lease_s=30, per_target=10, limit=100, in_flight={})
    assert again.delivery.id == retried.delivery.id
    assert [f.status for f in await queue.finish_many([attempted(again)], "n1")] == ["pending"]
    assert [a.n for a in (await webhooks.attempts([again.delivery.id]))[again.delivery.id]] == [1, 2]


# ----- retention -----------------------------------------------------------------------------------


async def test_prune_forgets_finished_deliveries_with_their_attempts(stores: Stores) -> None:
    queue = stores.deliveries
    await endpoint(stores.webhooks)
    await queue.fan_out([event("j1", 1), event("j2", 1), event("j3", 1)])
    items = await claim(queue)
    await finish(stores, items[0], OK, Plan("delivered"))
    await finish(stores, items[1], FAILED, Plan("failed"))
    cutoff = await stores.jobs.clock() + 1
    assert await queue.prune(cutoff, limit=1) == 1
    assert await queue.prune(cutoff) == 1
    assert await queue.prune(cutoff) == 0
    (left,) = await deliveries(stores)
    assert left["id"] == items[2].delivery.id and left["status"] == "pending"
    assert await stores.count("webhook_attempts") == 0
    assert [r["event_id"] for r in await stores.sql("SELECT event_id FROM webhook_messages")] == ["evt_j3.1"]


