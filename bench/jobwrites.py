"""What a trivial job writes to each store, counted exactly (issue 24, fewer writes per job).

``python -m bench.jobwrites [--store both] [--jobs 400] [--before 2000] [--concurrency 1]``

The job store's port alone, one process: ``before`` jobs first (so the table and its indexes
are not empty), then ``jobs`` jobs over ten tenants, each accepted, claimed and succeeded
(``concurrency`` at a time: 1 is a commit per write, more lets the group commit batch them),
then a heartbeat of each of 50 running jobs. No relay, no webhooks: what the job's own
writes cost. Counts, not timings, so one run is enough and the machine's load does not
matter:

* SQLite: WAL frames per job and per heartbeat (the store's checkpointer is held off by
  taking its role lock, so the WAL only grows), and which b-tree each frame wrote (the
  frame header's page number, its owner from ``dbstat``).
* PostgreSQL (a server of its own in a temp dir, fsync on): WAL records and bytes per job
  and per heartbeat (``pg_stat_wal``, read once every backend has flushed its counters),
  the updates of ``jobs`` that were HOT, and the indexes of ``jobs``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import fcntl
import os
import sqlite3
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Any

SECRET_KEY = "bench-jobwrites-secret-key-of-32-characters-x"
TENANTS = 10
HEARTBEATS = 50
# A backend's counters reach pg_stat_wal when it goes idle, at most this long after.
PG_STATS_FLUSH_S = 11.0


async def _jobs(store: Any, count: int, tag: str, concurrency: int) -> None:
    from herald.jobs import NewJob
    from herald.transitions import Change

    async def one(i: int) -> None:
        job_id = f"{tag}{i:06d}-{uuid.uuid4().hex[:6]}"
        await store.accept(NewJob(id=job_id, tenant=f"t{i % TENANTS}", kind="echo", collection="/echo",
                                  params=b"{}", deadline_s=600))
        await store.transition(job_id, Change(expect=("queued",), to="running", claim=True))
        await store.transition(job_id, Change(expect=("running",), to="succeeded", attempt=1,
                                              result_body=b'{"ok":1}', media_type="application/json"))

    slots = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> None:
        async with slots:
            await one(i)

    await asyncio.gather(*(guarded(i) for i in range(count)))


async def _running(store: Any) -> list[str]:
    from herald.jobs import NewJob
    from herald.transitions import Change

    ids = []
    for i in range(HEARTBEATS):
        job_id = f"hb{i:04d}-{uuid.uuid4().hex[:6]}"
        await store.accept(NewJob(id=job_id, tenant="t0", kind="echo", collection="/echo", params=b"{}",
                                  deadline_s=600))
        await store.transition(job_id, Change(expect=("queued",), to="running", claim=True))
        ids.append(job_id)
    return ids


async def sqlite_writes(root: Path, jobs: int, before: int, concurrency: int) -> None:
    from herald.settings import Settings
    from herald.storage import build_storage

    settings = Settings(data_dir=root / "data", secret_keys=(SECRET_KEY,), retention_s=3600)
    storage = build_storage(settings)
    await storage.jobs.open()
    try:
        db = next(p for p in settings.data_dir.iterdir() if p.suffix == ".db")
        role = os.open(str(db) + ".checkpoint", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(role, fcntl.LOCK_EX)  # the store's checkpointer waits for it: the WAL only grows
        await _jobs(storage.jobs, before, "pre", concurrency)
        running = await _running(storage.jobs)
        conn = sqlite3.connect(db)
        frame = conn.execute("PRAGMA page_size").fetchone()[0] + 24
        wal = str(db) + "-wal"
        start = os.path.getsize(wal)
        await _jobs(storage.jobs, jobs, "run", concurrency)
        end = os.path.getsize(wal)
        for job_id in running:
            await storage.jobs.heartbeat(job_id, 1)
        beats = os.path.getsize(wal) - end
        owners = {page: name for name, page in conn.execute("SELECT name, pageno FROM dbstat")}
        with open(wal, "rb") as f:
            f.seek(start)
            window = f.read(end - start)
        by_tree: collections.Counter[str] = collections.Counter()
        for offset in range(0, len(window) - frame + 1, frame):
            (page,) = struct.unpack(">I", window[offset:offset + 4])
            by_tree[owners.get(page, f"page {page}")] += 1
        conn.close()
        os.close(role)
        print(f"sqlite: {(end - start) / frame / jobs:.2f} WAL frames per job (concurrency {concurrency}),"
              f" {beats / frame / len(running):.2f} per heartbeat")
        print("  by b-tree, per job: " + ", ".join(f"{name} {n / jobs:.2f}" for name, n in by_tree.most_common()))
    finally:
        await storage.close()


async def postgres_writes(root: Path, jobs: int, before: int, concurrency: int) -> None:
    import asyncpg

    from bench.procs import free_port
    from herald.settings import Settings
    from herald.storage import build_storage
    from launcher.pgserver import PostgresServer

    server = PostgresServer(root / "pg", port=free_port())
    server.start()
    try:
        url = server.create_database("herald")
        storage = build_storage(Settings(database_url=url, secret_keys=(SECRET_KEY,), retention_s=3600))
        await storage.jobs.open()
        conn = await asyncpg.connect(url)
        try:
            await _jobs(storage.jobs, before, "pre", concurrency)
            running = await _running(storage.jobs)

            async def wal() -> asyncpg.Record:
                await asyncio.sleep(PG_STATS_FLUSH_S)
                return await conn.fetchrow("SELECT wal_records, wal_bytes FROM pg_stat_wal")

            start = await wal()
            await _jobs(storage.jobs, jobs, "run", concurrency)
            end = await wal()
            for job_id in running:
                await storage.jobs.heartbeat(job_id, 1)
            beats = await wal()
            updates = await conn.fetchrow(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs'")
            indexes = [r[0] for r in await conn.fetch(
                "SELECT indexrelname FROM pg_stat_user_indexes WHERE relname = 'jobs' ORDER BY 1")]
        finally:
            await conn.close()
            await storage.close()
        print(f"postgres: {(end['wal_records'] - start['wal_records']) / jobs:.1f} WAL records per job"
              f" ({(end['wal_bytes'] - start['wal_bytes']) / jobs / 1024:.2f} kB),"
              f" {(beats['wal_records'] - end['wal_records']) / len(running):.1f} per heartbeat;"
              f" updates of jobs {updates['n_tup_upd']}, HOT {updates['n_tup_hot_upd']}")
        print(f"  indexes of jobs: {', '.join(indexes)}")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--before", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jobwrites-") as tmp:
        if args.store in ("sqlite", "both"):
            asyncio.run(sqlite_writes(Path(tmp), args.jobs, args.before, args.concurrency))
        if args.store in ("postgres", "both"):
            asyncio.run(postgres_writes(Path(tmp), args.jobs, args.before, args.concurrency))


if __name__ == "__main__":
    main()
