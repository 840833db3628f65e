"""Workers share their slots fairly among tenants (SPEC §13), on both stores.

What another tenant sees while one tenant floods a kind: its jobs start within about one
run per slot, not behind the backlog; a tenant's ``max_running`` holds deployment-wide
while other tenants run; a tenant's own jobs start in the order accepted; and the backlog
guard refuses only the tenant whose queue is old.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from herald.kinds import declared_kinds
from herald.settings import Settings
from herald.tenants import DefaultLimits
from tests.harness import Deployment, client, wait_until
from workers.dispatch import HEAD_START_RUNS, KindQueue

A, B = "acme", "globex"


def start_reports(http: httpx.Client, count: int, pages: int, title: str) -> list[str]:
    """Start ``count`` reports, one after another (so their accept order is known)."""
    ids = []
    for n in range(count):
        response = http.post("/reports", json={"title": f"{title} {n}", "pages": pages})
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    return ids


def states(http: httpx.Client, ids: list[str]) -> list[str]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job_id: http.get(f"/jobs/{job_id}").json()["state"], ids))


def history(deployment: Deployment, tenant: str) -> list[dict[str, Any]]:
    """The tenant's committed events in commit order (seq), read straight from the store."""
    sql = "SELECT seq, job_id, type, at FROM events WHERE tenant = {p} ORDER BY seq"
    if deployment.database_url is None:
        import sqlite3

        with sqlite3.connect(f"file:{deployment.data_dir / 'herald.db'}?mode=ro", uri=True) as db:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute(sql.format(p="?"), (tenant,))]
    import asyncio

    import asyncpg

    async def read() -> list[dict[str, Any]]:
        conn = await asyncpg.connect(deployment.database_url)
        try:
            return [dict(r) for r in await conn.fetch(sql.format(p="$1"), tenant)]
        finally:
            await conn.close()

    return asyncio.run(read())


def most_running_at_once(events: list[dict[str, Any]]) -> int:
    """The largest number of the tenant's jobs running at one moment, from its history."""
    running: set[str] = set()
    most = 0
    for event in events:
        if event["type"] == "job.running":
            running.add(event["job_id"])
        elif event["type"] in ("job.succeeded", "job.failed", "job.cancelled", "job.queued"):
            running.discard(event["job_id"])
        most = max(most, len(running))
    return most


@pytest.fixture()
def deployment(fresh: Deployment) -> Iterator[Deployment]:
    fresh.env_overrides.update(HERALD_REPORT_PAGE_MS="40", HERALD_WORKER_CONCURRENCY="2")
    yield fresh


@pytest.mark.parametrize("workers", [1, 2])
def test_a_backlog_does_not_delay_another_tenant(deployment: Deployment, workers: int) -> None:
    """Tenant A queues 200 three-page reports; tenant B's five one-page reports then finish
    while most of A's backlog still waits (first in, first out they would finish last)."""
    base = deployment.start_gateway()
    for n in range(workers):
        deployment.start_worker(f"worker{n}")
    with client(base, A) as acme, client(base, B) as globex:
        backlog = start_reports(acme, 200, 3, "backlog")
        wait_until(lambda: "succeeded" in states(acme, backlog[:4]), timeout=60, what="the backlog running")

        started = time.monotonic()
        mine = start_reports(globex, 5, 1, "mine")
        wait_until(lambda: set(states(globex, mine)) == {"succeeded"}, timeout=60, interval=0.05,
                   what="tenant B's reports")
        took = time.monotonic() - started
        # One read, right away (200 single reads would let the backlog run on meanwhile).
        waiting = len(acme.get("/jobs", params={"state": "queued", "limit": 100}).json()["items"])

    # Every B job ran beside A's backlog, not after it (first in, first out, none of the
    # backlog would still wait): a good part of it was still waiting, even on a loaded machine.
    assert waiting >= 50, (waiting, took)
    # Runs of 3 pages of 40 ms on 2 slots per worker: B's five took a few runs' time, where
    # waiting behind the backlog would take 200 runs / slots.
    assert took < 15, took


def test_max_running_holds_across_workers_while_others_run(deployment: Deployment) -> None:
    """HERALD_TENANT_MAX_RUNNING=1, two workers of 2 slots: never more than one of a tenant's
    jobs runs at once, its others stay queued saying why, and the other tenant's jobs run
    meanwhile."""
    deployment.env_overrides["HERALD_TENANT_MAX_RUNNING"] = "1"
    base = deployment.start_gateway()
    deployment.start_worker("worker0")
    deployment.start_worker("worker1")
    with client(base, A) as acme, client(base, B) as globex:
        capped = start_reports(acme, 12, 3, "capped")
        others = start_reports(globex, 6, 1, "other")

        def a_waits_for_its_cap() -> dict[str, Any] | None:
            listed = acme.get("/jobs", params={"state": "queued", "limit": 100}).json()["items"]
            return next((j for j in listed if j["queued_reason"] == "tenant-max-running"), None)

        waiting = wait_until(a_waits_for_its_cap, timeout=60, what="a queued job waiting for its tenant's cap")
        single = acme.get(f"/jobs/{waiting['id']}").json()
        assert single["state"] != "queued" or single["queued_reason"] in ("tenant-max-running", "waiting-for-slot")

        wait_until(lambda: set(states(acme, capped) + states(globex, others)) == {"succeeded"}, timeout=120,
                   interval=0.1, what="every job done")
        assert acme.get(f"/jobs/{capped[0]}").json()["queued_reason"] is None  # not queued: no reason

    assert most_running_at_once(history(deployment, A)) == 1
    # B ran while A's jobs were still queued: B's last job succeeded before A's last began.
    a_events, b_events = history(deployment, A), history(deployment, B)
    last_a_start = max(e["at"] for e in a_events if e["type"] == "job.running")
    last_b_done = max(e["at"] for e in b_events if e["type"] == "job.succeeded")
    assert last_b_done < last_a_start


def test_a_tenants_jobs_start_in_the_order_accepted(deployment: Deployment) -> None:
    """Two tenants' jobs interleaved on one slot: each tenant's start in accept order, and
    the slot alternates between them (round robin at equal load)."""
    base = deployment.start_gateway()
    with client(base, A) as acme, client(base, B) as globex:
        first = start_reports(acme, 12, 1, "a")  # queued before any worker runs
        second = start_reports(globex, 12, 1, "b")
        deployment.start_worker(HERALD_WORKER_CONCURRENCY="1")
        wait_until(lambda: set(states(acme, first) + states(globex, second)) == {"succeeded"}, timeout=90,
                   interval=0.1, what="every job done")

    for tenant, ids in ((A, first), (B, second)):
        started = [e["job_id"] for e in history(deployment, tenant) if e["type"] == "job.running"]
        assert started == ids
    # Round robin: neither tenant had to wait for the other's twelve.
    runs = sorted((e["at"], tenant) for tenant in (A, B) for e in history(deployment, tenant)
                  if e["type"] == "job.running")
    first_half = [tenant for _at, tenant in runs[:12]]
    assert 4 <= first_half.count(A) <= 8, first_half


def test_the_backlog_guard_refuses_only_the_tenant_whose_queue_is_old(deployment: Deployment) -> None:
    """No worker runs; HERALD_MAX_QUEUE_AGE_S=1: once A's oldest queued job is older than
    that, A's starts get 503, while B (nothing queued) still gets 202."""
    base = deployment.start_gateway(HERALD_MAX_QUEUE_AGE_S="1")
    with client(base, A) as acme, client(base, B) as globex:
        start_reports(acme, 1, 1, "old")

        def refused() -> httpx.Response | None:
            response = acme.post("/reports", json={"title": "more", "pages": 1})
            return response if response.status_code == 503 else None

        refusal = wait_until(refused, timeout=30, interval=0.2, what="A refused")
        assert refusal.headers["content-type"].startswith("application/problem+json")
        assert refusal.headers["retry-after"] == "5"
        assert globex.post("/reports", json={"title": "fresh", "pages": 1}).status_code == 202


def test_any_tenant_name_becomes_one_subject_token() -> None:
    """Tenants from HERALD_API_KEYS may hold dots, spaces or wildcards: their work subject
    still has exactly one tenant token, and the tenant is read back from it."""
    from herald.constants import job_subject, tenant_from_token, tenant_token

    assert job_subject("report", "acme") == "jobs.report.acme"
    for tenant in ("acme", "a.b", "we *are* > you", "ÜBER", "~x"):
        token = tenant_token(tenant)
        assert not set(token) & set(".*> \t") and token
        assert tenant_from_token(token) == tenant
    assert len({tenant_token(t) for t in ("a.b", "a-b", "a_b", "~612e62")}) == 4


def test_a_tenant_that_gets_work_takes_turns_with_those_at_work_whatever_their_past(tmp_path: Path) -> None:
    """A flood that has just begun has no usage yet; the tenant that had been running alone
    has ten slot-seconds. The flood gets a start or two ahead, then they take turns. (By usage
    alone the flood took every free slot until it had caught up: seconds of the other tenant's
    jobs waiting, bench/RESULTS.md, issue 21.)"""
    settings = Settings(data_dir=tmp_path)
    kinds = KindQueue(declared_kinds()["report"], settings, cast(Any, None), cast(Any, None), DefaultLimits(settings))
    quiet = kinds.queue("quiet")
    quiet.charge(10.0, time.monotonic())  # ten slot-seconds lately, the last just now
    kinds.counted({"quiet": 5, "flood": 1000})
    flood = kinds.tenants["flood"]
    picks = kinds.choose(6)
    assert picks[:HEAD_START_RUNS] == [flood] * HEAD_START_RUNS
    assert picks.count(quiet) >= 2, picks
