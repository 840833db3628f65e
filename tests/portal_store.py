"""One scenario of the webhook store operations the portal added (issue 16), run against
each backend: ``tests/test_webhooks.py`` (SQLite) and ``tests/test_store_postgres_webhooks.py``."""

from __future__ import annotations

import time

import msgspec

from herald.deliveries import TEST_EVENT_TYPE, HealthRow, Outcome, Plan, new_test_event
from herald.storage.ports import DeliveryQueue, WebhookStore
from schemas import JobEvent

OK = Outcome(status_code=200, latency_s=0.01)
FAILED = Outcome(status_code=500, latency_s=0.01, response=b"down")
TYPES = ["job.queued", "job.succeeded"]


def _event(job_id: str, tenant: str = "t1") -> JobEvent:
    return JobEvent(seq=1, tenant=tenant, job_id=job_id, kind="report", version=1, type="job.succeeded",
                    at="2026-01-01T00:00:00Z", data=msgspec.Raw(msgspec.json.encode({"id": job_id, "version": 1})))


async def recover_test_events_and_health(webhooks: WebhookStore, queue: DeliveryQueue) -> None:
    endpoint, _ = await webhooks.create_endpoint("t1", url="https://hooks.example.com/p", event_types=TYPES,
                                                 kinds=None, signature="hmac-sha256")
    quiet, _ = await webhooks.create_endpoint("t1", url="https://hooks.example.com/q", event_types=["job.queued"],
                                              kinds=None, signature="ed25519")

    async def claim() -> list:  # type: ignore[type-arg]
        return await queue.claim("n1", lease_s=30, per_target=10, limit=10, in_flight={})

    assert await queue.fan_out([_event("job-a"), _event("job-b")]) == 2
    first = {c.delivery.job_id: c for c in await claim()}
    await queue.finish(first["job-a"], "n1", time.time(), FAILED, Plan("failed"))
    await queue.finish(first["job-b"], "n1", time.time(), OK, Plan("delivered"))

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
    await queue.finish(again[0], "n1", time.time(), OK, Plan("delivered"))

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
    await queue.finish(sent, "n1", time.time(), FAILED, Plan("failed"))
    await webhooks.update_endpoint("t1", endpoint.id, {"status": "disabled"})
    assert await webhooks.add_test_delivery("t1", endpoint.id, *new_test_event(), body) is None
    assert await webhooks.recover("t1", endpoint.id, 0) == 0
