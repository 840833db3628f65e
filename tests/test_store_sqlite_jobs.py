"""The SQLite job store's own mechanics.

What every backend promises is checked once per backend in ``tests/store_contract/``
(two processes' stores on one file included); the writer and its group commit in
``tests/test_sqlite_writer.py``. Here: a data dir an older Herald wrote is upgraded in
place, and the outbox rows it left still go out; a transition on a row the store remembers
is judged before the write lock.
"""

from __future__ import annotations

from pathlib import Path

from herald.storage.ports import OutboxRow
from herald.storage.sqlite.db import Database
from herald.storage.sqlite.jobs import SqliteJobStore
from herald.storage.sqlite.schema import SCHEMA
from tests.harness import make_sealer
from herald.transitions import Change
from tests.store_contract.support import CLAIM, new_job


def _jobs_of(rows: list[OutboxRow]) -> set[str]:
    return {r.msg_id.split(".")[1] if r.msg_id.startswith("ev.") else r.msg_id for r in rows}


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



async def test_a_transition_on_a_remembered_row_reads_no_job_under_the_write_lock(tmp_path: Path) -> None:
    """The write lock is every process's one queue (bench/RESULTS.md, issue 24): a worker's
    claim on the row it read, and its success on its claim, are judged and encoded before
    it; the transaction only compares-and-sets on that row. A row it does not remember is
    read in the transaction, as before."""
    store = SqliteJobStore(Database(tmp_path / "herald.db", SCHEMA), retention_s=60.0, sealer=make_sealer())
    await store.open()
    statements: list[str] = []
    try:
        writer = store._db._writer  # noqa: SLF001 -- what the transaction runs is not a port's to say
        assert writer is not None
        writer.set_trace_callback(statements.append)
        job = (await store.accept(new_job())).job
        store.remember(job)  # as a worker does with the row it read for the claim
        statements.clear()
        running = (await store.transition(job.id, CLAIM)).after
        done = (await store.transition(job.id, Change(expect={"running"}, to="succeeded", attempt=1))).after
        assert not [s for s in statements if s.startswith("SELECT * FROM jobs")], statements
        assert (running.version, done.version, done.state) == (2, 3, "succeeded")
        assert await store.get(job.id) == done

        unknown = (await store.accept(new_job())).job  # accepted here, never remembered
        statements.clear()
        await store.transition(unknown.id, CLAIM)
        assert [s for s in statements if s.startswith("SELECT * FROM jobs")], statements
    finally:
        await store.close()


async def test_a_full_store_is_unavailable_not_an_internal_error_and_recovers(tmp_path: Path) -> None:
    """SQLite answering "database or disk is full" (a full disk, here the file's own page cap,
    which fails the write the same way, SQLITE_FULL) is ``StoreUnavailable``: the gateway's
    503 with Retry-After, a worker's write tried again. It was the driver's OperationalError,
    so a cancel was a 500 and a worker failed a sound job as an internal error. Once there is
    room again the same store writes on."""
    import sqlite3

    import pytest

    from herald.jobs import StoreUnavailable

    store = SqliteJobStore(Database(tmp_path / "herald.db", SCHEMA), retention_s=60.0, sealer=make_sealer())
    await store.open()
    try:
        writer = store._db._writer  # noqa: SLF001 -- the file's cap is set on the connection that writes
        assert writer is not None
        job = (await store.accept(new_job())).job
        await store.transition(job.id, CLAIM)
        pages = writer.execute("PRAGMA page_count").fetchone()[0]
        writer.execute(f"PRAGMA max_page_count={pages}")
        with pytest.raises(StoreUnavailable) as raised:
            for _ in range(1000):  # each start adds a job, an event and outbox rows: the file must grow
                await store.accept(new_job())
        with pytest.raises(StoreUnavailable):  # a cancel, a worker's end: the same, never the driver's error
            await store.transition(job.id, Change(expect={"running"}, to="cancelled", attempt=1))
        assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
        writer.execute("PRAGMA max_page_count=1073741823")
        cancelled = (await store.transition(job.id, Change(expect={"running"}, to="cancelled", attempt=1))).after
        assert cancelled.state == "cancelled"
    finally:
        await store.close()
