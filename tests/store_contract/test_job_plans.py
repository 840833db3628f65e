"""The job store's hot reads stay index lookups on every backend (issue 24).

Migration 5 (SQLite) and 16 (PostgreSQL) folded five indexes of ``jobs`` into one,
``jobs_live_by_tenant``, so that a transition writes fewer index entries. These plans are
what that must not cost: each hot read of ``jobs`` is served by an index, never a scan of
the table; so is each read of a tenant's or a job's events (SQLite's migration 6 made
``events`` a rowid table with its key in an index). On PostgreSQL, sequential scans are
priced out of the test's session (``enable_seqscan = off``) so that a small table's cheap
scan is not chosen: a plan that still reads the table sequentially has no index that
serves it.
"""

from __future__ import annotations

from herald.storage.postgres import jobs as pg_jobs
from herald.storage.sqlite import jobs as sqlite_jobs
from tests.store_contract.conftest import Stores
from tests.store_contract.support import new_job, running_job

# (what, the statement as the store sends it (PostgreSQL's $n), its arguments, the index that must serve it)
COMMON = [
    ("a job by id", "SELECT * FROM jobs WHERE id = $1", ("j",), None),
    ("a tenant's running jobs (capped claim, fair share)",
     "SELECT COUNT(*) FROM jobs WHERE state = 'running' AND tenant = $1", ("t1",), "jobs_live_by_tenant"),
    ("a tenant's oldest queued job of a kind (back-pressure)",
     "SELECT MIN(created_at) FROM jobs WHERE state = 'queued' AND kind = $1 AND tenant = $2", ("report", "t1"),
     "jobs_live_by_tenant"),
    ("a tenant's page of jobs", "SELECT * FROM jobs WHERE tenant = $1 ORDER BY created_at DESC, id DESC LIMIT $2",
     ("t1", 50), "jobs_by_tenant"),
    ("a tenant's events after a seq (feed, tenant stream)",
     "SELECT * FROM events WHERE tenant = $1 AND seq > $2 ORDER BY seq LIMIT $3", ("t1", 0, 100), "events_by_seq"),
    ("a job's events after a version", "SELECT * FROM events WHERE job_id = $1 AND version > $2 ORDER BY version"
     " LIMIT $3", ("j", 0, 1000), "events_by_job"),
    ("jobs whose retention ended",
     "SELECT * FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= $1 ORDER BY expires_at LIMIT $2",
     (1.0, 500), "jobs_expiring"),
]
PLANS = {
    "sqlite": COMMON + [
        ("each kind's oldest queued job (/metrics)", sqlite_jobs._QUEUED_SINCE_BY_KIND, (), "jobs_live_by_tenant"),
        ("the sweeper's live jobs",
         "SELECT * FROM jobs WHERE (state = 'queued' OR state = 'running')"
         " AND ((state = 'running' AND COALESCE(heartbeat_at, 0) < $1) OR deadline_at < $2)", (1.0, 1.0),
         "jobs_live_by_tenant"),
    ],
    "postgres": COMMON + [
        ("each kind's oldest queued job (/metrics)", pg_jobs._QUEUED_AGES, (["report", "export"],),
         "jobs_live_by_tenant"),
        ("the oldest queued job and the outbox (/metrics)", pg_jobs._STATS, ([],), "jobs_live_by_tenant"),
        ("tenants' running jobs (gateway, worker)", pg_jobs._RUNNING_COUNTS, (["t1", "t2"],), "jobs_live_by_tenant"),
        ("the sweeper's live jobs",
         "SELECT * FROM jobs WHERE state IN ('queued', 'running')"
         " AND ((state = 'running' AND COALESCE(heartbeat_at, 0) < $1) OR deadline_at < $2)",
         (1.0, 1.0), "jobs_live_by_tenant"),
    ],
}


async def _plan(stores: Stores, sql: str, args: tuple[object, ...]) -> str:
    if stores.backend == "postgres":
        await stores.sql("SET enable_seqscan = off")
        return "\n".join(r["QUERY PLAN"] for r in await stores.sql("EXPLAIN " + sql, *args))
    return "\n".join(r["detail"] for r in await stores.sql("EXPLAIN QUERY PLAN " + sql, *args))


async def test_hot_reads_of_jobs_are_index_lookups(stores: Stores) -> None:
    for tenant in ("t1", "t2"):  # some rows in each state, so that the plans read a real table
        await stores.jobs.accept(new_job(tenant))
        await running_job(stores.jobs, tenant)

    wrong = []
    for what, sql, args, index in PLANS[stores.backend]:
        plan = await _plan(stores, sql, args)
        scans = [line for line in plan.splitlines()
                 if any(f"Seq Scan on {table}" in line or line.strip().startswith((f"SCAN {table}", "SCAN j "))
                        or line.strip() == "SCAN j" for table in ("jobs", "events"))]
        if scans:
            wrong.append(f"{what}: reads a whole table\n{plan}")
        elif index is not None and index not in plan:
            wrong.append(f"{what}: not served by {index}\n{plan}")
    assert not wrong, "\n\n".join(wrong)
