"""The PostgreSQL delivery queue's lock order, against a real server.

What every backend promises (fan-out, order, superseding, exclusive claims, leases,
outcomes) is checked once per backend in ``tests/store_contract/``. Here stays what only
this backend's locks decide: a batch of outcomes and a fan-out of the same jobs, in two
processes at once, take their per-(target, job) advisory locks in one order and do not
deadlock. Each test gets a fresh database (``fresh_database``) on the session's server;
"two notifiers" are two processes' stores (two pools) on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from herald.deliveries import Attempted, Plan
from herald.settings import Settings
from herald.storage import build_storage
from herald.storage.ports import Storage
from tests.harness import SECRET_KEY
from tests.store_contract.support import FAILED, claim, endpoint, event


async def _open(url: str) -> Storage:
    storage = build_storage(Settings(database_url=url, secret_keys=(SECRET_KEY,)))
    await storage.jobs.open()
    return storage


@pytest.fixture()
async def notifiers(fresh_database: str) -> AsyncIterator[tuple[Storage, Storage]]:
    """Two processes' stores on one database, each with its own pool: two notifiers."""
    a, b = await _open(fresh_database), await _open(fresh_database)
    try:
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_a_batch_of_outcomes_and_a_fan_out_of_the_same_jobs_at_once_do_not_deadlock(
    notifiers: tuple[Storage, Storage], fresh_database: str
) -> None:
    """finish_many takes its order locks sorted, as fan-out does: both finish, and the retried
    deliveries with a newer version behind them end superseded."""
    (one, two), webhooks = notifiers, notifiers[0].webhooks
    queue, other = one.deliveries, two.deliveries
    await endpoint(webhooks)
    await endpoint(webhooks, url="https://example.com/other")
    jobs = [f"job-{n}" for n in range(20)]
    assert (await queue.fan_out([event(j, 1, "job.queued") for j in jobs])).pending == 40
    claimed = await claim(queue, per_target=100)
    assert len(claimed) == 40
    attempts = [Attempted(claimed=c, started_at=0.0, outcome=FAILED, plan=Plan("retry", delay_s=60)) for c in claimed]
    finished, pending = await asyncio.gather(
        queue.finish_many(attempts, "n1"), other.fan_out([event(j, 2, "job.running") for j in reversed(jobs)]))
    assert len(finished) == 40 and pending.pending >= 0
    assert {f.status for f in finished} <= {"pending", "superseded"}
    conn = await asyncpg.connect(fresh_database)
    try:
        rows = await conn.fetch("SELECT * FROM webhook_deliveries ORDER BY seq")
    finally:
        await conn.close()
    older = [r for r in rows if r["version"] == 1]
    assert all(r["attempts"] == 1 and r["lease_owner"] is None for r in older)
    # Whichever committed first, no version-1 delivery waits for a retry behind a version 2.
    assert all(r["status"] == "superseded" for r in older)
