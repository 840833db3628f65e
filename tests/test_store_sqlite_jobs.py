"""The SQLite job store's outbox, two processes' stores on one file.

What a user relies on: every committed event reaches NATS once, from the process that
committed it, and the rows of a process that died are published by any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from herald.storage.ports import OutboxRow
from herald.storage.sqlite.db import Database
from herald.storage.sqlite.jobs import SqliteJobStore
from herald.storage.sqlite.schema import SCHEMA
from tests.harness import make_sealer
from tests.test_store_postgres_jobs import new_job


@pytest.fixture()
async def processes(tmp_path: Path) -> AsyncIterator[tuple[SqliteJobStore, SqliteJobStore]]:
    """Two stores on one file, each with its own connections and writer: two processes."""
    a, b = (SqliteJobStore(Database(tmp_path / "herald.db", SCHEMA), retention_s=60.0, sealer=make_sealer()) for _ in range(2))
    await asyncio.gather(a.open(), b.open())
    try:
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())


def _jobs_of(rows: list[OutboxRow]) -> set[str]:
    return {r.msg_id.split(".")[1] if r.msg_id.startswith("ev.") else r.msg_id for r in rows}


async def test_each_process_publishes_its_own_rows_and_anyone_those_left_behind(
    processes: tuple[SqliteJobStore, SqliteJobStore],
) -> None:
    a, b = processes
    from_a = [(await a.accept(new_job())).job.id for _ in range(2)]
    from_b = [(await b.accept(new_job())).job.id for _ in range(3)]

    assert _jobs_of(await a.outbox_batch(100)) == set(from_a)
    assert _jobs_of(await b.outbox_batch(100)) == set(from_b)
    assert await a.outbox_batch(100, stale_after_s=60) == []
    await b.close()
    stale = await a.outbox_batch(100, stale_after_s=0)
    assert _jobs_of(stale) == set(from_a) | set(from_b) and [r.seq for r in stale] == sorted(r.seq for r in stale)
    await a.outbox_done([r.seq for r in stale])
    assert await a.outbox_batch(100, stale_after_s=0) == []


async def test_a_data_dir_from_before_outbox_origins_is_upgraded(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "herald.db"
    with sqlite3.connect(path) as conn:  # an outbox as an older Herald made it, with a row left in it
        legacy = (Path(__file__).parent / "legacy_schema" / "sqlite.sql").read_text()
        conn.executescript(legacy.replace("    tracestate TEXT,\n    origin TEXT\n", "    tracestate TEXT\n"))
        assert "origin" not in {r[1] for r in conn.execute("PRAGMA table_info(outbox)")}
        conn.execute("INSERT INTO outbox (subject, msg_id, payload, created_at) VALUES ('jobs.report', 'j1', x'00', 0)")
    store = SqliteJobStore(Database(path, SCHEMA), retention_s=60.0, sealer=make_sealer())
    await store.open()
    try:
        assert [r.msg_id for r in await store.outbox_batch(10, stale_after_s=1)] == ["j1"]  # the old row still goes out
        job = (await store.accept(new_job())).job
        assert _jobs_of(await store.outbox_batch(10)) == {job.id}
    finally:
        await store.close()


async def test_an_accepted_job_is_the_row_a_read_returns(processes: tuple[SqliteJobStore, SqliteJobStore]) -> None:
    a, b = processes
    accepted = await a.accept(new_job(callback_url="https://example.com/hook"))
    assert await b.get(accepted.job.id) == accepted.job


async def test_a_capped_claim_never_takes_the_tenants_last_slot_twice(
    processes: tuple[SqliteJobStore, SqliteJobStore],
) -> None:
    """SPEC §13 max_running, two processes on one file: ten claims at once with a cap of 2,
    exactly two run and the rest stay queued (TENANT_AT_CAP)."""
    from herald.jobs import TransitionRejected
    from herald.transitions import TENANT_AT_CAP, Change

    a, b = processes
    jobs = [(await a.accept(new_job("capped"))).job.id for _ in range(10)]
    capped = Change(expect={"queued"}, to="running", claim=True, max_running=2)
    outcomes = await asyncio.gather(*((a if n % 2 else b).transition(job_id, capped) for n, job_id in enumerate(jobs)),
                                    return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(refused) == 8 and all(isinstance(o, TransitionRejected) and o.reason == TENANT_AT_CAP for o in refused)
    assert await b.running_counts(["capped"]) == {"capped": 2}
    assert await a.tenant_queued_age("report", "capped") >= 0.0 and await a.tenant_queued_age("report", "x") == 0.0
