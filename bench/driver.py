"""Making committed changes from the bench process, the way a worker makes them.

``Driver`` opens its own job store on the deployment's store (``build_storage``: the SQLite
file, or the PostgreSQL database) and runs its own outbox ``Relay`` to NATS, exactly as a
``herald worker`` process does. So a transition it commits travels the production path to
every subscriber: store commit, relay, JetStream, the gateway's hub, the stream or long
poll. The bench notes the wall clock just before it asks for the transition: latencies
include the commit itself.

``seed_jobs`` writes many queued jobs fast for the poll scenario: the same job and history
rows ``accept`` writes, without outbox rows, since these jobs are only ever read. SQLite:
thousands per transaction, with the store's own helpers. PostgreSQL: ``COPY`` into
``jobs`` and ``events`` and the tenant's ``tenant_seq`` row moved past them, in one
transaction holding that row, as ``herald_append_event`` would have it (gap-free seq).
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
from herald.sealing import load_sealer
from herald.storage import build_storage
from herald.storage.sqlite.db import Database
from herald.storage.sqlite.jobs import SqliteJobStore, _append_event, _fetch
from herald.storage.sqlite.schema import SCHEMA
from herald.transitions import Change
from herald.timefmt import now
from schemas import JobEvent, ReportParams

REPORT_PARAMS = msgspec.json.encode(ReportParams(title="bench", pages=1))


def new_job(tenant: str, callback_url: str | None = None) -> NewJob:
    return NewJob(id=str(uuid.uuid4()), tenant=tenant, kind="report", collection="/reports", params=REPORT_PARAMS,
                  deadline_s=3600.0, callback_url=callback_url)


class Driver:
    """``Driver(herald.store_settings())``: the deployment's store and NATS."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = build_storage(self.settings).jobs
        self._relay_task: asyncio.Task[None] | None = None
        self._nc = None
        self._relay: Relay | None = None

    async def __aenter__(self) -> Driver:
        await self.store.open()
        self._nc = await jetstream.connect(self.settings, name="herald-bench-driver")
        js = self._nc.jetstream()
        await jetstream.ensure_topology(js, self.settings)
        self._relay = Relay(self.store, self._nc, sweep_interval_s=1.0)
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

    async def last_event(self, job_id: str) -> JobEvent:
        """The job's newest history event (its status JSON is what subscribers receive)."""
        return (await self.store.job_events(job_id, 0))[-1]

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


def new_jobs(tenant: str, n: int) -> list[NewJob]:
    return [new_job(tenant) for _ in range(n)]


async def seed_jobs(settings: Settings, jobs: list[NewJob], chunk: int = 5000) -> list[str]:
    """``jobs`` as queued report jobs in the store ``settings`` name (no outbox rows)."""
    if settings.database_url is not None:
        await _seed_postgres(settings, jobs, chunk)
    else:
        await seed_sqlite(settings.db_path, jobs, chunk)
    return [job.id for job in jobs]


async def seed_sqlite(db_path: Path, jobs: list[NewJob], chunk: int = 5000) -> None:
    """Rows and history as ``SqliteJobStore.accept`` writes them, no outbox."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    db = Database(db_path, SCHEMA)
    # The data dir's own secret key: the store is the deployment's (or the baseline's own file).
    store = SqliteJobStore(db, retention_s=86400.0, sealer=load_sealer(Settings(data_dir=db_path.parent)))
    await store.open()
    try:
        for start in range(0, len(jobs), chunk):
            batch = jobs[start:start + chunk]

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
                    _append_event(conn, row, "job.queued", db.origin)
                # Read-only jobs: nothing to announce (only this batch's rows go).
                conn.execute("DELETE FROM outbox WHERE seq > ?", (last_outbox,))

            await db.write(tx)
    finally:
        await store.close()


_JOB_COLUMNS = ("id", "tenant", "kind", "collection", "state", "params", "progress", "version", "attempt",
                "cancel_requested", "created_at", "updated_at", "heartbeat_at", "deadline_at", "finished_at",
                "expires_at", "result_path", "media_type", "error", "callback_url")
_EVENT_COLUMNS = ("tenant", "seq", "job_id", "kind", "version", "type", "at", "data")


async def _seed_postgres(settings: Settings, jobs: list[NewJob], chunk: int) -> None:
    """Rows and history as ``herald_accept`` writes them (its own row builder), no outbox."""
    import asyncpg

    from herald.storage.postgres.jobs import _queued_row

    # The schema first, as a Herald process creates it (migrations under the advisory lock).
    storage = build_storage(settings)
    await storage.jobs.open()
    await storage.jobs.close()
    encoder = msgspec.json.Encoder()
    conn = await asyncpg.connect(settings.database_url)
    try:
        for start in range(0, len(jobs), chunk):
            batch = jobs[start:start + chunk]
            async with conn.transaction():
                ts = float(await conn.fetchval("SELECT extract(epoch from clock_timestamp())::double precision"))
                tenants = sorted({job.tenant for job in batch})
                last: dict[str, int] = {}
                for tenant in tenants:  # locked until commit: no accept interleaves its seq
                    last[tenant] = int(await conn.fetchval(
                        "INSERT INTO tenant_seq AS s (tenant, last) VALUES ($1, 0)"
                        " ON CONFLICT (tenant) DO UPDATE SET last = s.last RETURNING s.last", tenant))
                job_rows, event_rows = [], []
                for job in batch:
                    row = _queued_row(job, ts)
                    last[job.tenant] += 1
                    job_rows.append(tuple(getattr(row, c) for c in _JOB_COLUMNS))
                    event_rows.append((row.tenant, last[job.tenant], row.id, row.kind, 1, "job.queued", ts,
                                       encoder.encode(row.status())))
                await conn.copy_records_to_table("jobs", records=job_rows, columns=list(_JOB_COLUMNS))
                await conn.copy_records_to_table("events", records=event_rows, columns=list(_EVENT_COLUMNS))
                for tenant in tenants:
                    await conn.execute("UPDATE tenant_seq SET last = $2 WHERE tenant = $1", tenant, last[tenant])
    finally:
        await conn.close()
