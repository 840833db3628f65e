"""Both stores decide as the rulebook does (``herald.delivery_rules``), over one table of cases.

SQLite calls the rulebook; PostgreSQL makes the same decisions in plpgsql next to the data
(fan-out and finish are one round trip each). So each case is set up in the store as rows
(through the back door: a delivery that was tried twice, a lease that ran out, an endpoint
failing for five days), the store is asked through its port, and what it wrote is compared
with what the rulebook says of the same rows at the store's own time. A plpgsql function
that drifts from the rulebook fails here, case by case.
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from herald import delivery_rules as rules
from herald.deliveries import Attempted, Claimed, DeliveryRow, Outcome, Plan, callback_owner
from herald.delivery_rules import ENDPOINT_DISABLE_AFTER_S, ROTATION_OVERLAP_S
from tests.store_contract.conftest import Stores
from tests.store_contract.support import FAILED, GONE, OK, claim, endpoint, event

PROGRESS = "job.progress"
HELD = 60.0  # a lease this far ahead is held; this far behind, it ran out


# ----- placement: fan-out -------------------------------------------------------------------


@dataclass(frozen=True)
class Prior:
    """A delivery already there for the job and target; times relative to the case's start."""

    version: int
    status: str = "pending"
    type: str = "job.running"
    attempts: int = 0
    scheduled: float = -10.0
    lease: float | None = None  # +HELD: held now; -HELD: ran out


PLACEMENTS: dict[str, tuple[list[Prior], int, str]] = {
    # name: (what is there, the new event's version and type)
    "first": ([], 1, "job.queued"),
    "redelivered": ([Prior(1, "delivered", attempts=1), Prior(2, type="job.succeeded")], 2, "job.succeeded"),
    "newer-delivered": ([Prior(3, "delivered", "job.succeeded", attempts=1)], 2, "job.running"),
    "newer-retrying": ([Prior(3, attempts=1)], 2, "job.running"),
    "newer-leased": ([Prior(3, lease=HELD)], 2, "job.running"),
    "newer-sent-then-superseded": ([Prior(3, "superseded", attempts=2)], 2, "job.running"),
    "newer-waiting": ([Prior(3)], 2, "job.running"),
    "newer-lease-ran-out": ([Prior(3, lease=-HELD)], 2, "job.running"),
    "newer-superseded-unsent": ([Prior(3, "superseded")], 2, "job.running"),
    "newer-progress-waiting": ([Prior(5, type=PROGRESS, scheduled=0.5)], 4, PROGRESS),
    "older-mix": ([
        Prior(1, attempts=2),  # waiting for a retry
        Prior(2, type=PROGRESS),  # waiting for its progress slot
        Prior(3),  # never attempted: goes first
        Prior(4, attempts=1, lease=HELD),  # being sent now
        Prior(5, "failed", attempts=3),  # finished
    ], 6, "job.succeeded"),
    "older-retry-lease-ran-out": ([Prior(1, attempts=1, lease=-HELD)], 2, "job.succeeded"),
    "progress-after-one-sent": ([Prior(2, "delivered", PROGRESS, 1, scheduled=-0.25)], 3, PROGRESS),
    "progress-long-after": ([Prior(2, "delivered", PROGRESS, 1, scheduled=-5.0)], 3, PROGRESS),
    "progress-takes-the-slot-of-one-it-supersedes": ([
        Prior(2, "delivered", PROGRESS, 1, scheduled=-0.25), Prior(3, type=PROGRESS, scheduled=0.75)], 4, PROGRESS),
    "progress-after-one-tried-then-superseded": ([
        Prior(2, "delivered", PROGRESS, 1, scheduled=-0.25), Prior(3, "superseded", PROGRESS, 1, scheduled=0.5)],
        4, PROGRESS),
    "progress-after-one-being-sent": ([Prior(3, type=PROGRESS, scheduled=-0.5, lease=HELD)], 4, PROGRESS),
    "not-progress-ignores-slots": ([Prior(2, "delivered", PROGRESS, 1, scheduled=-0.25)], 3, "job.succeeded"),
}


async def _insert_delivery(stores: Stores, *, job: str, version: int, type: str, status: str, attempts: int,
                           scheduled_at: float, lease_until: float | None, endpoint_id: str | None, target: str,
                           url: str | None = None, lease_owner: str | None = None) -> str:
    delivery_id = f"{target}/{job}/{version}"
    await stores.sql(
        "INSERT INTO webhook_deliveries (id, tenant, target, endpoint_id, url, event_id, job_id, version, type,"
        " status, attempts, scheduled_at, next_attempt_at, lease_owner, lease_until, created_at, updated_at)"
        " VALUES ($1, 't1', $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $15)",
        delivery_id, target, endpoint_id, url, f"evt_{job}.{version}", job, version, type, status, attempts,
        scheduled_at, scheduled_at if status == "pending" else None, lease_owner, lease_until, scheduled_at - 1.0)
    return delivery_id


async def test_fan_out_places_each_event_as_the_rulebook_does(stores: Stores) -> None:
    target = await endpoint(stores.webhooks)
    t0 = await stores.jobs.clock()
    before: dict[str, list[rules.Sibling]] = {}
    for job, (priors, _, _) in PLACEMENTS.items():
        before[job] = []
        for p in priors:
            lease_until = t0 + p.lease if p.lease is not None else None
            await _insert_delivery(stores, job=job, version=p.version, type=p.type, status=p.status,
                                   attempts=p.attempts, scheduled_at=t0 + p.scheduled, lease_until=lease_until,
                                   endpoint_id=target, target=target)
            before[job].append(rules.Sibling(f"evt_{job}.{p.version}", p.version, p.type, p.status, p.attempts,
                                             t0 + p.scheduled, lease_until))

    # One batch, as a notifier fans out what it read from the stream.
    pending = await stores.deliveries.fan_out([event(job, version, type) for job, (_, version, type)
                                               in PLACEMENTS.items()])

    expected_pending = 0
    for job, (priors, version, type) in PLACEMENTS.items():
        rows = {r["version"]: r for r in await stores.sql(
            "SELECT * FROM webhook_deliveries WHERE job_id = $1", job)}
        new = rows[version]
        at = new["created_at"]  # the store's time of the fan-out
        placement = rules.place(before[job], event_id=f"evt_{job}.{version}", version=version, type=type, at=at)
        if placement is None:
            assert len(rows) == len(priors) and new["status"] == "pending" and new["created_at"] < t0, job
        else:
            assert len(rows) == len(priors) + 1, job
            assert (new["status"], new["scheduled_at"], new["next_attempt_at"], new["attempts"]) == (
                placement.status, placement.due, placement.next_attempt_at, 0), job
            expected_pending += placement.status == "pending"
        for sibling in before[job]:
            if sibling.version == version:
                continue
            row = rows[sibling.version]
            if placement is not None and sibling.version in placement.supersede:
                assert (row["status"], row["next_attempt_at"]) == ("superseded", None), (job, sibling.version)
            else:
                assert row["status"] == sibling.status, (job, sibling.version)
    assert pending.pending == expected_pending


# ----- settlement: finish -----------------------------------------------------------------------

RETRY = Plan("retry", delay_s=120.0)
DISABLE = Plan("failed", disable_endpoint=True)
NEVER = math.inf  # no failing streak


@dataclass(frozen=True)
class Attempt:
    plan: Plan
    outcome: Outcome
    newer: bool = False
    endpoint: str | None = "enabled"  # None: a job's callback URL
    failing: float = NEVER  # the endpoint's streak began this long before the case started
    asked: bool = False  # a retry was asked for while the attempt was in flight


SETTLEMENTS: dict[str, Attempt] = {
    "delivered": Attempt(Plan("delivered"), OK),
    "delivered-ends-a-streak": Attempt(Plan("delivered"), OK, failing=100.0),
    "delivered-with-a-newer-one": Attempt(Plan("delivered"), OK, newer=True),
    "delivered-at-a-disabled-endpoint": Attempt(Plan("delivered"), OK, endpoint="disabled", failing=100.0),
    "retry-starts-a-streak": Attempt(RETRY, FAILED),
    "retry-keeps-a-streak": Attempt(RETRY, FAILED, failing=100.0),
    "retry-with-a-newer-one-is-superseded": Attempt(RETRY, FAILED, newer=True),
    "failed-with-a-newer-one": Attempt(Plan("failed"), FAILED, newer=True),
    "gone-disables": Attempt(DISABLE, GONE),
    "five-days-of-failing-disable": Attempt(RETRY, FAILED, failing=ENDPOINT_DISABLE_AFTER_S),
    "nearly-five-days-retries": Attempt(RETRY, FAILED, failing=ENDPOINT_DISABLE_AFTER_S - 600.0),
    "retry-at-a-disabled-endpoint-fails": Attempt(RETRY, FAILED, endpoint="disabled"),
    "callback-delivered": Attempt(Plan("delivered"), OK, endpoint=None),
    "callback-retry": Attempt(RETRY, FAILED, endpoint=None),
    "callback-gone-disables-nothing": Attempt(DISABLE, GONE, endpoint=None),
    "asked-retry-is-now": Attempt(RETRY, FAILED, asked=True),
    "asked-failed-is-now": Attempt(Plan("failed"), FAILED, asked=True),
    "asked-with-a-newer-one-is-now": Attempt(RETRY, FAILED, newer=True, asked=True),
    "asked-delivered": Attempt(Plan("delivered"), OK, asked=True),
    "asked-gone-disables": Attempt(DISABLE, GONE, asked=True),
    "asked-at-a-disabled-endpoint-fails": Attempt(RETRY, FAILED, endpoint="disabled", asked=True),
    "asked-callback-retry-is-now": Attempt(RETRY, FAILED, endpoint=None, asked=True),
}


@dataclass
class Placed:
    case: Attempt
    delivery_id: str
    endpoint_id: str | None
    bystander_id: str | None  # another job's pending delivery to the same endpoint
    out_id: str | None  # another job's delivery to the same endpoint, being sent by another notifier
    newer_id: str | None
    failing_since: float | None
    claimed: Claimed | None = None


async def _set_up_attempts(stores: Stores, t0: float) -> dict[str, Placed]:
    placed: dict[str, Placed] = {}
    for job, case in SETTLEMENTS.items():
        endpoint_id = None
        failing_since = t0 - case.failing if case.failing != NEVER else None
        if case.endpoint is not None:
            endpoint_id = await endpoint(stores.webhooks, url=f"https://{job}.example/hook")
            await stores.sql("UPDATE webhook_endpoints SET status = $2, failing_since = $3 WHERE id = $1",
                             endpoint_id, case.endpoint, failing_since)
        target = endpoint_id or f"callback:https://{job}.example/cb"
        url = None if endpoint_id else target.removeprefix("callback:")
        common: dict[str, Any] = {"type": "job.running", "endpoint_id": endpoint_id, "target": target, "url": url}
        delivery_id = await _insert_delivery(stores, job=job, version=1, status="pending", attempts=0,
                                             scheduled_at=t0 - 5.0, lease_until=t0 + HELD, lease_owner="n1", **common)
        newer_id = bystander_id = out_id = None
        if case.newer:
            newer_id = await _insert_delivery(stores, job=job, version=2, status="pending", attempts=0,
                                              scheduled_at=t0 - 4.0, lease_until=None, **common)
        if endpoint_id is not None:
            bystander_id = await _insert_delivery(stores, job=f"{job}-other", version=1, status="pending", attempts=0,
                                                  scheduled_at=t0 - 3.0, lease_until=None, **common)
            out_id = await _insert_delivery(stores, job=f"{job}-out", version=1, status="pending", attempts=0,
                                            scheduled_at=t0 - 2.0, lease_until=t0 + HELD, lease_owner="n2", **common)
        if case.asked:
            await stores.sql("UPDATE webhook_deliveries SET retry_asked_at = $2 WHERE id = $1", delivery_id, t0)
        [row] = await stores.sql("SELECT * FROM webhook_deliveries WHERE id = $1", delivery_id)
        claimed = Claimed(delivery=DeliveryRow.from_mapping(row), url=url or "https://x.example/", body=b"{}", keys=())
        placed[job] = Placed(case, delivery_id, endpoint_id, bystander_id, out_id, newer_id, failing_since, claimed)
    return placed


@pytest.mark.parametrize("batch", [False, True], ids=["finish", "finish_many"])
async def test_finish_settles_each_attempt_as_the_rulebook_does(stores: Stores, batch: bool) -> None:
    t0 = await stores.jobs.clock()
    placed = await _set_up_attempts(stores, t0)
    started = t0 - 1.0
    if batch:
        attempts = [Attempted(claimed=p.claimed, started_at=started, outcome=p.case.outcome, plan=p.case.plan)
                    for p in placed.values() if p.claimed is not None]
        answers = dict(zip(placed, await stores.deliveries.finish_many(attempts, "n1"), strict=True))
    else:
        answers = {}
        for job, p in placed.items():
            assert p.claimed is not None
            answers[job] = await stores.deliveries.finish(p.claimed, "n1", started, p.case.outcome, p.case.plan)

    for job, p in placed.items():
        [row] = await stores.sql("SELECT * FROM webhook_deliveries WHERE id = $1", p.delivery_id)
        at = row["updated_at"]  # the store's time of the finish
        state = None
        if p.endpoint_id is not None:
            assert p.case.endpoint is not None
            state = rules.EndpointState(p.case.endpoint, p.failing_since)
        settled = rules.settle(p.case.plan, ok=p.case.outcome.ok, newer=p.case.newer, endpoint=state, at=at,
                               retry_asked=p.case.asked)
        answer = answers[job]
        assert (answer.status, answer.next_attempt_at, answer.endpoint_disabled) == (
            settled.status, settled.next_attempt_at, settled.endpoint_disabled), job
        assert (row["status"], row["next_attempt_at"], row["attempts"], row["lease_owner"], row["lease_until"],
                row["retry_asked_at"]) == (settled.status, settled.next_attempt_at, 1, None, None, None), job
        [logged] = await stores.sql("SELECT * FROM webhook_attempts WHERE delivery_id = $1", p.delivery_id)
        assert (logged["n"], logged["at"], logged["status_code"]) == (1, started, p.case.outcome.status_code), job
        if p.endpoint_id is not None:
            [e] = await stores.sql("SELECT status, failing_since FROM webhook_endpoints WHERE id = $1", p.endpoint_id)
            assert e["failing_since"] == settled.failing_since, job
            assert e["status"] == ("disabled" if settled.endpoint_disabled or p.case.endpoint == "disabled"
                                   else "enabled"), job
            # The endpoint's other deliveries: disabling fails the one that waits, not the one out.
            for other_id, lease_until in ((p.bystander_id, None), (p.out_id, t0 + HELD)):
                [other] = await stores.sql("SELECT status, lease_until FROM webhook_deliveries WHERE id = $1",
                                           other_id)
                fails = settled.disable and rules.fails_with_its_endpoint("pending", lease_until, at)
                assert (other["status"], other["lease_until"]) == (
                    ("failed", None) if fails else ("pending", lease_until)), (job, other_id)
        if p.newer_id is not None:
            [newer] = await stores.sql("SELECT status FROM webhook_deliveries WHERE id = $1", p.newer_id)
            assert newer["status"] == ("failed" if settled.disable else "pending"), job


# ----- keys: rotation, and the keys that sign -------------------------------------------------

# name: the owner's keys before the rotation, as (created, retires) relative to the case's start
ROTATIONS: dict[str, list[tuple[float, float | None]]] = {
    "first-key": [],
    "current-only": [(-20.0, None)],
    "current-and-one-in-its-overlap": [(-50_000.0, 100.0), (-20.0, None)],
    "one-past-its-overlap-is-forgotten": [(-90_000.0, -10.0), (-50_000.0, 100.0), (-20.0, None)],
    "current-made-at-a-later-reading": [(600.0, None)],
    "only-retired-keys": [(-90_000.0, -10.0), (-50_000.0, 100.0)],
}


async def test_rotation_changes_the_keys_as_the_rulebook_does(stores: Stores) -> None:
    t0 = await stores.jobs.clock()
    for tenant, stamps in ROTATIONS.items():
        owner = callback_owner(tenant)
        seeded = [rules.KeyTimes(t0 + created, t0 + retires if retires is not None else None)
                  for created, retires in stamps]
        for key in seeded:
            await stores.sql("INSERT INTO webhook_keys (owner, created_at, algorithm, secret, retire_at)"
                             " VALUES ($1, $2, 'hmac-sha256', $3, $4)", owner, key.created_at, b"sealed", key.retire_at)

        await stores.webhooks.rotate_callback_key(tenant)

        after = {r["created_at"]: r["retire_at"] for r in await stores.sql(
            "SELECT created_at, retire_at FROM webhook_keys WHERE owner = $1", owner)}
        [made] = [t for t in after if t not in {k.created_at for k in seeded}]
        retired = [k for k in seeded if k.retire_at is None and k.created_at in after]
        # The store's time of the rotation: what the retired key now retires at, less the overlap;
        # with nothing to retire, the new key's own time.
        at = after[retired[0].created_at] - ROTATION_OVERLAP_S if retired else made
        rotation = rules.rotate(seeded, at)
        assert sorted(after) == sorted({k.created_at for k in seeded} - set(rotation.forget) | {made}), tenant
        assert made == pytest.approx(rotation.created_at, abs=5e-7), tenant
        assert after[made] is None, tenant
        for key in seeded:
            if key.created_at in rotation.retire:
                assert after[key.created_at] == pytest.approx(rotation.retire_at, abs=5e-7), tenant
            elif key.created_at in after:
                assert after[key.created_at] == key.retire_at, tenant


# name: when each of an endpoint's three keys (oldest first) retires, relative to the case's start
SIGNING: dict[str, tuple[float | None, float | None, float | None]] = {
    "current-only": (-600.0, -300.0, None),
    "current-and-one-in-its-overlap": (-600.0, 900.0, None),
    "both-older-in-their-overlap": (600.0, 900.0, None),
}


async def test_a_claim_signs_with_the_keys_the_rulebook_names(stores: Stores) -> None:
    t0 = await stores.jobs.clock()
    expected: dict[str, list[bytes]] = {}
    for name, retires in SIGNING.items():
        endpoint_row, first = await stores.webhooks.create_endpoint(
            "t1", url=f"https://{name}.example/hook", event_types=["job.succeeded"], kinds=None, signature="hmac-sha256")
        keys = [first]
        for _ in range(2):
            rotated = await stores.webhooks.rotate_endpoint_key("t1", endpoint_row.id)
            assert rotated is not None
            keys.append(rotated)
        made = sorted(r["created_at"] for r in await stores.sql(
            "SELECT created_at FROM webhook_keys WHERE owner = $1", endpoint_row.id))
        assert len(made) == 3
        for created, retire in zip(made, retires, strict=True):
            await stores.sql("UPDATE webhook_keys SET retire_at = $3 WHERE owner = $1 AND created_at = $2",
                             endpoint_row.id, created, t0 + retire if retire is not None else None)
        times = [rules.KeyTimes(created, t0 + retire if retire is not None else None)
                 for created, retire in zip(made, retires, strict=True)]
        # minutes from now, either side: whenever the claim below runs, the same keys sign
        expected[endpoint_row.id] = [k.secret for k in rules.signing_keys(zip(times, keys, strict=True), t0)]
        await stores.deliveries.fan_out([event(f"signed-{name}", 1)])

    claimed = await claim(stores.deliveries, lease_s=30.0)
    assert {c.delivery.endpoint_id for c in claimed} == set(expected)
    for c in claimed:
        assert [k.secret for k in c.keys] == expected[c.delivery.endpoint_id], c.delivery.endpoint_id


# ----- the keys both stores keep, which the rules rely on -------------------------------------


async def test_one_delivery_per_event_and_target_and_one_current_key_per_owner(stores: Stores) -> None:
    refused = (sqlite3.IntegrityError, asyncpg.UniqueViolationError)
    target = await endpoint(stores.webhooks)
    await stores.deliveries.fan_out([event("j1", 1)])
    with pytest.raises(refused):
        await _insert_delivery(stores, job="j1", version=1, type="job.succeeded", status="pending", attempts=0,
                               scheduled_at=0.0, lease_until=None, endpoint_id=target, target=target)
    key = "INSERT INTO webhook_keys (owner, created_at, algorithm, secret) VALUES ($1, $2, 'hmac-sha256', $3)"
    with pytest.raises(refused):  # the endpoint's first key is its current one
        await stores.sql(key, target, 1.0, b"sealed")
