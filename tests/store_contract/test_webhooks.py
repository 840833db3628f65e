"""The webhook store's contract (``herald.storage.ports.WebhookStore``), on every backend:
endpoints and their tenancy, signing keys and their rotation, the delivery log the API and
the portal read (retry now, recover, test events, health)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from herald.deliveries import (
    TEST_EVENT_TYPE,
    TEST_EVENT_WINDOW_S,
    TEST_EVENTS_PER_WINDOW,
    EndpointLimitReached,
    HealthRow,
    Outcome,
    Plan,
    TestEventsLimited,
    callback_owner,
    new_test_event,
)
from herald.delivery_rules import ROTATION_OVERLAP_S
from schemas import JobEvent
from tests.store_contract.conftest import Stores
from tests.store_contract.support import FAILED, OK, claim, deliveries, endpoint, event, finish, outcomes


async def test_endpoint_crud_and_tenant_isolation(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    before = await stores.jobs.clock()
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
    assert (await queue.fan_out([event("j1", 1)])).pending == 1 + 3  # this endpoint and the three others
    disabled = await webhooks.update_endpoint("t1", row.id, {"status": "disabled"})
    assert disabled is not None and disabled.status == "disabled"
    assert [d["status"] for d in await deliveries(stores, endpoint_id=row.id)] == ["failed"]
    assert (await queue.fan_out([event("j2", 1)])).pending == 3
    assert await deliveries(stores, endpoint_id=row.id, job_id="j2") == []

    # Re-enabling restarts the 5-day clock.
    await stores.sql("UPDATE webhook_endpoints SET failing_since = 1 WHERE id = $1", row.id)
    enabled = await webhooks.update_endpoint("t1", row.id, {"status": "enabled"})
    assert enabled is not None and enabled.status == "enabled" and enabled.failing_since is None

    # Delete takes the keys, deliveries and attempts with it.
    item = next(c for c in await claim(queue) if c.delivery.endpoint_id == ids[1])
    await finish(stores, item, OK, Plan("delivered"))
    assert await webhooks.delete_endpoint("t1", ids[1]) is True
    assert await webhooks.get_endpoint("t1", ids[1]) is None
    assert await deliveries(stores, endpoint_id=ids[1]) == []
    assert await webhooks.attempts([item.delivery.id]) == {item.delivery.id: []}
    assert await stores.count("webhook_keys", "owner = $1", ids[1]) == 0
    assert await webhooks.delete_endpoint("t1", ids[1]) is False


async def test_rotation_keeps_both_keys_signing_for_the_overlap(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    row, first = await webhooks.create_endpoint("t1", url="https://a.example/hook", event_types=["job.succeeded"],
                                                kinds=None, signature="hmac-sha256")
    second = await webhooks.rotate_endpoint_key("t1", row.id)
    assert second is not None and second != first

    await queue.fan_out([event("j1", 1)])
    (item,) = await claim(queue)
    assert item.keys == (second, first)  # newest first: both sign during the overlap
    [retiring] = await stores.sql("SELECT retire_at FROM webhook_keys WHERE owner = $1 AND retire_at IS NOT NULL",
                                  row.id)
    assert retiring["retire_at"] == pytest.approx(await stores.jobs.clock() + ROTATION_OVERLAP_S, abs=5)

    # Once the overlap is over only the current key signs, and the next rotation drops the old one.
    await stores.sql("UPDATE webhook_keys SET retire_at = 1 WHERE owner = $1 AND retire_at IS NOT NULL", row.id)
    await queue.fan_out([event("j2", 1)])
    (item2,) = [c for c in await claim(queue, "n2") if c.delivery.job_id == "j2"]
    assert item2.keys == (second,)
    third = await webhooks.rotate_endpoint_key("t1", row.id)
    assert await stores.count("webhook_keys", "owner = $1", row.id) == 2
    assert third is not None and third not in (first, second)

    # Concurrent rotations of one owner take turns: one current key, the others overlapping.
    await asyncio.gather(*(webhooks.rotate_endpoint_key("t1", row.id) for _ in range(5)))
    assert await stores.count("webhook_keys", "owner = $1 AND retire_at IS NULL", row.id) == 1
    assert await stores.count("webhook_keys", "owner = $1", row.id) == 7

    # The callback secret rotates the same way.
    old = await webhooks.callback_key("t1")
    new = await webhooks.rotate_callback_key("t1")
    assert new != old and await webhooks.callback_key("t1") == new
    assert await stores.count("webhook_keys", "owner = $1 AND retire_at > 0", callback_owner("t1")) == 1


async def test_callback_key_is_created_once_under_concurrent_first_use(stores: Stores) -> None:
    webhooks, other = stores.webhooks, (await stores.another()).webhooks
    keys = await asyncio.gather(*(s.callback_key("t1") for s in [webhooks, other] * 5))
    assert len(set(keys)) == 1
    assert await stores.count("webhook_keys", "owner = $1", callback_owner("t1")) == 1
    assert await webhooks.callback_key("t2") != keys[0]  # per tenant


async def test_retry_now(stores: Stores) -> None:
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    other_endpoint = await endpoint(webhooks, url="https://other.example/hook")
    await queue.fan_out([event("j1", 1)])
    item = next(c for c in await claim(queue) if c.delivery.endpoint_id == endpoint_id)
    await finish(stores, item, FAILED, Plan("failed"))

    assert await webhooks.retry_now(other_endpoint, item.delivery.id) is None  # not that endpoint's
    assert (await webhooks.get_delivery(endpoint_id, item.delivery.id)).status == "failed"  # type: ignore[union-attr]
    before = await stores.jobs.clock()
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



async def test_a_retry_asked_while_the_attempt_is_in_flight_is_kept_for_its_record(stores: Stores) -> None:
    """``POST .../retry`` of a delivery being sent: the attempt's own record used to set its next
    attempt by the plan, so a failing attempt waited the schedule's delay (or gave up), the
    request lost. It is kept now: a failure is due again at once; a 2xx delivers it."""
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint_id = await endpoint(webhooks)
    await queue.fan_out([event("j1", 1), event("j2", 1), event("j3", 1)])
    sent = {c.delivery.job_id: c for c in await claim(queue)}
    assert set(sent) == {"j1", "j2", "j3"}
    for item in sent.values():
        row = await webhooks.retry_now(endpoint_id, item.delivery.id)
        assert row is not None and row.status == "pending"

    retried = await finish(stores, sent["j1"], FAILED, Plan("retry", delay_s=300.0))
    given_up = await finish(stores, sent["j2"], FAILED, Plan("failed"))  # its last retry, by the schedule
    delivered = await finish(stores, sent["j3"], OK, Plan("delivered"))
    after = await stores.jobs.clock()
    assert (retried.status, given_up.status, delivered.status) == ("pending", "pending", "delivered")
    assert retried.next_attempt_at is not None and retried.next_attempt_at <= after  # now, not in 300 s
    assert given_up.next_attempt_at is not None and given_up.next_attempt_at <= after
    assert [(r["job_id"], r["status"], r["attempts"], r["retry_asked_at"]) for r in await deliveries(stores)] == [
        ("j1", "pending", 1, None), ("j2", "pending", 1, None), ("j3", "delivered", 1, None)]

    # Sent again at once; the request is used up: this attempt's failure waits as planned.
    again = {c.delivery.job_id: c for c in await claim(queue)}
    assert set(again) == {"j1", "j2"}
    later = await finish(stores, again["j1"], FAILED, Plan("retry", delay_s=300.0))
    assert later.status == "pending" and later.next_attempt_at is not None
    assert later.next_attempt_at >= await stores.jobs.clock() + 250
    # A retry of a delivery not in flight is due now, nothing kept.
    await finish(stores, again["j2"], FAILED, Plan("failed"))
    row = await webhooks.retry_now(endpoint_id, again["j2"].delivery.id)
    assert row is not None and row.status == "pending"
    [stored] = await deliveries(stores, job_id="j2")
    assert stored["retry_asked_at"] is None


DELIVERED = Outcome(status_code=200, latency_s=0.01)
REFUSED = Outcome(status_code=500, latency_s=0.01, response=b"down")
PORTAL_TYPES = ["job.queued", "job.succeeded"]


def _job_event(job_id: str, tenant: str = "t1") -> JobEvent:
    return JobEvent(seq=1, tenant=tenant, job_id=job_id, kind="report", version=1, type="job.succeeded",
                    at="2026-01-01T00:00:00Z", data=msgspec.Raw(msgspec.json.encode({"id": job_id, "version": 1})))


async def test_recover_test_events_and_health(stores: Stores) -> None:
    """The portal's store operations (issue 16): endpoint health over a window, recover the
    failed deliveries since a time (same delivery, same webhook-id), test events through the
    same queue; a disabled endpoint gets neither."""
    webhooks, queue = stores.webhooks, stores.deliveries
    endpoint, _ = await webhooks.create_endpoint("t1", url="https://hooks.example.com/p", event_types=PORTAL_TYPES,
                                                 kinds=None, signature="hmac-sha256")
    quiet, _ = await webhooks.create_endpoint("t1", url="https://hooks.example.com/q", event_types=["job.queued"],
                                              kinds=None, signature="ed25519")

    async def claim() -> list:  # type: ignore[type-arg]
        return await queue.claim("n1", lease_s=30, per_target=10, limit=10, in_flight={})

    assert (await queue.fan_out([_job_event("job-a"), _job_event("job-b")])).pending == 2
    first = {c.delivery.job_id: c for c in await claim()}
    await queue.finish(first["job-a"], "n1", time.time(), REFUSED, Plan("failed"))
    await queue.finish(first["job-b"], "n1", time.time(), DELIVERED, Plan("delivered"))

    health = await webhooks.endpoint_health([endpoint.id, quiet.id], 100)
    assert (health[endpoint.id].delivered, health[endpoint.id].failed) == (1, 1)
    last = health[endpoint.id].last
    assert last is not None and last.job_id == "job-b" and last.status == "delivered"  # the newest
    assert health[quiet.id] == HealthRow(delivered=0, failed=0, last=None)
    assert (await webhooks.endpoint_health([endpoint.id], 1))[endpoint.id].failed == 0  # the window

    # Recover: the failed one, created since then, of this tenant's enabled endpoint; once.
    assert await webhooks.recover("t2", endpoint.id, 0) == 0
    assert await webhooks.recover("t1", endpoint.id, time.time() + 60) == 0
    assert await webhooks.recover("t1", endpoint.id, 0) == 1
    assert await webhooks.recover("t1", endpoint.id, 0) == 0  # pending now, not failed
    again = await claim()
    assert [(c.delivery.id, c.delivery.event_id) for c in again] == [
        (first["job-a"].delivery.id, first["job-a"].delivery.event_id)]  # same delivery, same webhook-id
    await queue.finish(again[0], "n1", time.time(), DELIVERED, Plan("delivered"))

    # A test event: a delivery of no job, through the same queue, signed with the endpoint's keys.
    body = b'{"type":"webhook.test","timestamp":"2026-01-01T00:00:00.000Z","data":{}}'
    event_id, job_key = new_test_event()
    row = await webhooks.add_test_delivery("t1", endpoint.id, event_id, job_key, body)
    assert row is not None and row.type == TEST_EVENT_TYPE and row.status == "pending"
    assert row.endpoint_id == endpoint.id and row.event_id == event_id and row.target == endpoint.id
    assert await webhooks.add_test_delivery("t2", endpoint.id, *new_test_event(), body) is None
    assert await webhooks.messages([event_id, "evt_nope"]) == {event_id: body}
    [sent] = await claim()
    assert sent.delivery.id == row.id and sent.body == body and sent.keys and sent.url == endpoint.url
    # Test events share no job, so one never waits behind another.
    more = [await webhooks.add_test_delivery("t1", endpoint.id, *new_test_event(), body) for _ in range(2)]
    assert sorted(c.delivery.id for c in await claim()) == sorted(r.id for r in more if r is not None)
    listed = await webhooks.list_deliveries(endpoint.id, status=None, before_seq=None, limit=10)
    assert [r.type for r in listed][:3] == [TEST_EVENT_TYPE] * 3

    # A disabled endpoint gets neither.
    await queue.finish(sent, "n1", time.time(), REFUSED, Plan("failed"))
    await webhooks.update_endpoint("t1", endpoint.id, {"status": "disabled"})
    assert await webhooks.add_test_delivery("t1", endpoint.id, *new_test_event(), body) is None
    assert await webhooks.recover("t1", endpoint.id, 0) == 0


async def test_recover_and_test_events_wait_for_nothing_a_concurrent_disable_misses(stores: Stores) -> None:
    """ports.py, ``recover``: the endpoint is checked in the same transaction, so a concurrent
    disable wins cleanly. Racing a disable from another process, nothing is left pending on a
    disabled endpoint."""
    webhooks, queue = stores.webhooks, stores.deliveries
    other = (await stores.another()).webhooks
    for _ in range(10):
        endpoint_id = await endpoint(webhooks)
        assert (await queue.fan_out([event(f"job-{endpoint_id}", 1)])).pending == 1
        [item] = await claim(queue)
        await queue.finish(item, "n1", 0.0, FAILED, Plan("failed"))
        body = b'{"type":"webhook.test"}'
        await asyncio.gather(
            webhooks.recover("t1", endpoint_id, 0),
            webhooks.add_test_delivery("t1", endpoint_id, *new_test_event(), body),
            other.update_endpoint("t1", endpoint_id, {"status": "disabled"}),
        )
        assert [r for r in await deliveries(stores, endpoint_id=endpoint_id) if r["status"] == "pending"] == []


async def test_max_endpoints_holds_for_creations_at_two_gateways_at_once(stores: Stores) -> None:
    """ports.py, ``create_endpoint``: counted and inserted as one step, so concurrent creations
    at several gateways cannot pass the cap together."""
    a, b = stores.webhooks, (await stores.another()).webhooks
    results = await outcomes([(a if n % 2 else b).create_endpoint(
        "t1", url=f"https://{n}.example/hook", event_types=["job.succeeded"], kinds=None, signature="hmac-sha256",
        max_endpoints=3) for n in range(10)])
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(refused) == 7 and all(isinstance(r, EndpointLimitReached) and r.limit == 3 for r in refused), refused
    assert len(await a.list_endpoints("t1", before=None, limit=100)) == 3
    await endpoint(b, tenant="t2", max_endpoints=3)  # another tenant's count is its own
    await endpoint(a, max_endpoints=None)  # None: no cap
    assert len(await b.list_endpoints("t1", before=None, limit=100)) == 4
    # 0 allows none (the limit reads as its name says; no cap is None): not even a first one.
    with pytest.raises(EndpointLimitReached):
        await endpoint(a, tenant="t3", max_endpoints=0)
    assert await a.list_endpoints("t3", before=None, limit=100) == []


async def test_test_events_are_limited_per_endpoint_across_gateways(stores: Stores) -> None:
    """ports.py, ``add_test_delivery``: at most TEST_EVENTS_PER_WINDOW per endpoint in the
    window, counted from the store, so across every gateway."""
    a, b = stores.webhooks, (await stores.another()).webhooks
    endpoint_id, other_id = await endpoint(a), await endpoint(a, url="https://other.example/hook")
    body = b'{"type":"webhook.test"}'
    for n in range(TEST_EVENTS_PER_WINDOW):
        assert await (a if n % 2 else b).add_test_delivery("t1", endpoint_id, *new_test_event(), body) is not None
    for gateway in (a, b):
        try:
            await gateway.add_test_delivery("t1", endpoint_id, *new_test_event(), body)
        except TestEventsLimited as limited:
            assert 0 < limited.retry_after_s <= TEST_EVENT_WINDOW_S
        else:
            raise AssertionError("a test event past the window's limit was queued")
    assert await b.add_test_delivery("t1", other_id, *new_test_event(), body) is not None  # per endpoint
    assert len(await a.list_deliveries(endpoint_id, status=None, before_seq=None, limit=100)) == TEST_EVENTS_PER_WINDOW
