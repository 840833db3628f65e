"""Making committed changes from the bench process, the way a worker makes them.

``Driver`` opens its own job store (the SQLite backend) on the deployment's data file and runs
its own outbox ``Relay`` to NATS, exactly as a ``herald worker`` process does. So a
transition it commits travels the production path to every subscriber: SQLite commit,
relay, JetStream, the gateway's hub, the stream or long poll. The bench notes the wall
clock just before it asks for the transition: latencies include the commit itself.

``seed_jobs`` writes many queued jobs fast for the poll scenario: the same job and
history rows ``Store.accept`` writes (it reuses the store's own helpers), thousands per
transaction and without outbox rows, since these jobs are only ever read.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
import uuid
from pathlib import Path
from types import TracebackType

import msgspec

from herald import jetstream
from herald.relay import Relay
from herald.settings import Settings
from herald.jobs import NewJob
from herald.storage import build_storage
from herald.storage.sqlite.db import Database
from herald.storage.sqlite.jobs import SCHEMA, SqliteJobStore, _append_event, _fetch
from herald.transitions import Change
from herald.timefmt import now
from schemas import ReportParams

REPORT_PARAMS = msgspec.json.encode(ReportParams(title="bench", pages=1))


def new_job(tenant: str, callback_url: str | None = None) -> NewJob:
    return NewJob(id=str(uuid.uuid4()), tenant=tenant, kind="report", collection="/reports", params=REPORT_PARAMS,
                  deadline_s=3600.0, callback_url=callback_url)


class Driver:
    def __init__(self, db_path: Path, nats_url: str) -> None:
        self.settings = Settings(data_dir=db_path.parent, nats_url=nats_url)
        self.store = build_storage(self.settings).jobs
        self._relay_task: asyncio.Task[None] | None = None
        self._nc = None
        self._relay: Relay | None = None

    async def __aenter__(self) -> Driver:
        await self.store.open()
        self._nc = await jetstream.connect(self.settings, name="herald-bench-driver")
        js = self._nc.jetstream()
        await jetstream.ensure_topology(js, self.settings)
        self._relay = Relay(self.store, js, sweep_interval_s=1.0)
        self._relay_task = asyncio.create_task(self._relay.run(), name="bench-relay")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._relay_task is not None:
            self._relay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._relay_task
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()
        await self.store.close()

    async def accept(self, tenant: str, n: int = 1) -> list[str]:
        ids = []
        for _ in range(n):
            accepted = await self.store.accept(new_job(tenant))
            ids.append(accepted.job.id)
        return ids

    async def transition(self, job_id: str, change: Change) -> float:
        """Commit ``change``; returns the wall-clock time just before it was asked for."""
        started = time.time()
        await self.store.transition(job_id, change)
        return started

    async def drained(self, timeout: float = 30.0) -> bool:
        """Wait until the relay has published every outbox row."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (await self.store.stats()).outbox_pending == 0:
                return True
            assert self._relay is not None
            self._relay.kick()
            await asyncio.sleep(0.02)
        return False


def step(k: int) -> Change:
    """The k-th change of a driven job (k from 1): claim it, then move its progress."""
    if k == 1:
        return Change(expect={"queued"}, to="running", claim=True)
    return Change(expect={"running"}, attempt=1, progress=min(99, k * 5))


async def seed_jobs(db_path: Path, tenant: str, n: int, chunk: int = 5000) -> list[str]:
    """``n`` queued report jobs (rows and history as ``Store.accept`` writes them, no outbox)."""
    db = Database(db_path, SCHEMA)
    store = SqliteJobStore(db, retention_s=86400.0)
    await store.open()
    ids: list[str] = []
    try:
        for start in range(0, n, chunk):
            batch = [new_job(tenant) for _ in range(min(chunk, n - start))]

            def tx(conn: sqlite3.Connection, batch: list[NewJob] = batch) -> None:
                ts = now()
                (last_outbox,) = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM outbox").fetchone()
                for job in batch:
                    conn.execute(
                        "INSERT INTO jobs (id, tenant, kind, collection, state, params, progress, version, attempt,"
                        " created_at, updated_at, deadline_at, callback_url)"
                        " VALUES (?,?,?,?, 'queued', ?, NULL, 1, 0, ?, ?, ?, ?)",
                        (job.id, job.tenant, job.kind, job.collection, job.params, ts, ts, ts + job.deadline_s, None),
                    )
                    row = _fetch(conn, job.id)
                    assert row is not None
                    _append_event(conn, row, "job.queued")
                # Read-only jobs: nothing to announce (only this batch's rows go).
                conn.execute("DELETE FROM outbox WHERE seq > ?", (last_outbox,))

            await db.write(tx)
            ids.extend(job.id for job in batch)
    finally:
        await store.close()
    return ids
