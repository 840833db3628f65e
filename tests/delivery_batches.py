"""Attempts recorded in batches (``DeliveryQueue.finish_many``, issue 14), one scenario run
against each backend: ``tests/test_webhooks.py`` (SQLite) and
``tests/test_store_postgres_webhooks.py``."""

from __future__ import annotations

import time

import msgspec

from herald.deliveries import Attempted, Claimed, Outcome, Plan
from herald.storage.ports import DeliveryQueue, WebhookStore
from schemas import JobEvent

OK = Outcome(status_code=200, latency_s=0.012, response=b"thanks")
FAILED = Outcome(status_code=500, latency_s=0.02, error=None, response=b"boom")
REFUSED = Outcome(status_code=None, latency_s=0.003, error="ClientConnectorError: refused")
GONE = Outcome(status_code=410, latency_s=0.01)
RETRY_IN_S = 300.0


def _event(job_id: str, type: str) -> JobEvent:
    return JobEvent(seq=1, tenant="t1", job_id=job_id, kind="report", version=1, type=type,
                    at="2026-01-01T00:00:00Z", data=msgspec.Raw(msgspec.json.encode({"id": job_id, "version": 1})))


async def many_attempts_recorded_in_one_batch(webhooks: WebhookStore, queue: DeliveryQueue) -> None:
    """Deliveries to several endpoints finishing together, each with its own outcome, are all
    recorded by one ``finish_many``: attempt rows, statuses, retries, leases, endpoint health."""

    async def add(path: str, types: list[str]) -> str:
        row, _ = await webhooks.create_endpoint("t1", url=f"https://hooks.example.com/{path}", event_types=types,
                                                kinds=None, signature="hmac-sha256")
        return row.id

    ok_a, ok_b, failing, refusing = [await add(p, ["job.succeeded"]) for p in ("a", "b", "c", "r")]
    gone = await add("g", ["job.failed"])
    deleted = await add("d", ["job.succeeded"])
    jobs = [f"job-{n}" for n in range(5)]
    events = [_event(j, "job.succeeded") for j in jobs] + [_event("job-x", "job.failed")]
    assert await queue.fan_out(events) == 5 * 5 + 1
    claimed = await queue.claim("n1", lease_s=30, per_target=10, limit=100, in_flight={})
    assert len(claimed) == 26
    await webhooks.delete_endpoint("t1", deleted)  # while its attempts were in flight

    def decide(item: Claimed) -> tuple[Outcome, Plan]:
        d = item.delivery
        if d.endpoint_id == failing:  # two will be retried, three have used up their schedule
            return FAILED, Plan("retry", delay_s=RETRY_IN_S) if d.job_id in jobs[:2] else Plan("failed")
        if d.endpoint_id == refusing:
            return REFUSED, Plan("retry", delay_s=RETRY_IN_S)
        if d.endpoint_id == gone:
            return GONE, Plan("failed", disable_endpoint=True)
        return OK, Plan("delivered")

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
        (refusing, ["pending"] * 5, None, None, REFUSED.error),
        (gone, ["failed"], 410, None, None),
    ):
        rows = await webhooks.list_deliveries(endpoint_id, status=None, before_seq=None, limit=100)
        assert sorted(r.status for r in rows) == sorted(statuses), endpoint_id
        assert all(r.lease_owner is None and r.lease_until is None for r in rows)
        # (SQLite: a 410 fails the endpoint's pending deliveries, this one included, before its
        # own update, which then keeps its attempt count at 0; PostgreSQL counts it.)
        assert all(r.attempts == 1 for r in rows) or endpoint_id == gone
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
    done = await queue.finish_many([Attempted(claimed=c, started_at=time.time(), outcome=OK, plan=Plan("delivered"))
                                    for c in again], "n1")
    assert [f.status for f in done] == ["delivered", "delivered"]
    logged = await webhooks.attempts([c.delivery.id for c in again])
    assert all([a.status_code for a in logged[c.delivery.id]] == [500, 200] for c in again)
    health = await webhooks.get_endpoint("t1", failing)
    assert health is not None and health.failing_since is None  # a success ends the failing streak
