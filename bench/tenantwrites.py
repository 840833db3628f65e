"""One tenant's write rate on the PostgreSQL job store, against ten tenants' (issue 24).

``python -m bench.tenantwrites [--processes 3] [--concurrency 16] [--seconds 10] [--pg-set NAME=VALUE]``

The store alone, without HTTP, NATS or handlers, so that what a tenant-wide serialisation
costs is not hidden behind the rest of a job's CPU. A PostgreSQL server
(``launcher.pgserver``, fsync and synchronous commit on) in a temp dir; ``processes``
processes, each with its own job store (its pool and group commit, as a gateway or a worker
has) and its relay's side of the store (``outbox_batch`` then ``outbox_done`` in a loop, as
``herald.relay`` does, the publishing left out), each running ``concurrency`` loops of
accept → claim → succeed (three events) for ``seconds``: first every job of one tenant, then
of ten tenants at random, each on a database of its own. Prints events committed per second
for each, their ratio, and whether every event ended up numbered once.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

_CTX = multiprocessing.get_context("spawn")
SECRET_KEY = "bench-tenantwrites-secret-key-of-32-characters"


def _tenants(count: int) -> list[str]:
    return [f"t{i}" for i in range(count)]


async def _run(url: str, tenants: list[str], concurrency: int, seconds: float, start_at: float) -> int:
    from herald.jobs import NewJob
    from herald.settings import Settings
    from herald.storage import build_storage
    from herald.transitions import Change

    storage = build_storage(Settings(data_dir=Path(tempfile.mkdtemp(prefix="tenantwrites-")), database_url=url,
                                     secret_keys=(SECRET_KEY,)))
    store = storage.jobs
    await store.open()
    claim = Change(expect={"queued"}, to="running", claim=True)
    succeed = Change(expect={"running"}, to="succeeded", attempt=1)
    events = 0
    await asyncio.sleep(max(0.0, start_at - time.time()))
    deadline = time.monotonic() + seconds
    stop = asyncio.Event()

    async def loop() -> None:
        nonlocal events
        while time.monotonic() < deadline:
            new = NewJob(id=uuid.uuid4().hex, tenant=random.choice(tenants), kind="report", collection="/reports",
                         params=b'{"title":"t","pages":1}', deadline_s=600.0, callback_url=None)
            job = (await store.accept(new)).job
            await store.transition(job.id, claim)
            await store.transition(job.id, succeed)
            events += 3

    async def relay() -> None:
        while not stop.is_set():
            rows = await store.outbox_batch(256)
            if rows:
                await store.outbox_done([r.seq for r in rows])
            else:
                await asyncio.sleep(0.002)

    relaying = asyncio.create_task(relay())
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    stop.set()
    await relaying
    await storage.close()
    return events


def _child(args: tuple[str, list[str], int, float, float]) -> int:
    return asyncio.run(_run(*args))


async def _numbered(url: str, tenants: list[str]) -> tuple[int, int]:
    """Events stored, and the sum over tenants of their last seq, after a last relay pass."""
    from herald.settings import Settings
    from herald.storage import build_storage

    storage = build_storage(Settings(data_dir=Path(tempfile.mkdtemp(prefix="tenantwrites-")), database_url=url,
                                     secret_keys=(SECRET_KEY,)))
    await storage.jobs.open()
    try:
        while rows := await storage.jobs.outbox_batch(10_000, stale_after_s=0.0):
            await storage.jobs.outbox_done([r.seq for r in rows])
        import asyncpg

        conn = await asyncpg.connect(url)
        try:
            stored = int(await conn.fetchval("SELECT count(*) FROM events"))
        finally:
            await conn.close()
        return stored, sum([await storage.jobs.last_event_seq(t) for t in tenants])
    finally:
        await storage.close()


def measure(url: str, tenants: list[str], processes: int, concurrency: int, seconds: float) -> dict[str, Any]:
    start_at = time.time() + 2.0
    with _CTX.Pool(processes) as pool:
        counts = pool.map(_child, [(url, tenants, concurrency, seconds, start_at)] * processes)
    stored, numbered = asyncio.run(_numbered(url, tenants))
    return {"tenants": len(tenants), "events": sum(counts), "events_per_s": round(sum(counts) / seconds, 1),
            "stored": stored, "numbered": numbered}


def main() -> None:
    from launcher.pgserver import PostgresServer

    from bench.procs import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--pg-set", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tenantwrites-pg-"))
    server = PostgresServer(root / "data", port=free_port(),
                            settings=dict(item.split("=", 1) for item in args.pg_set))
    server.start()
    try:
        results = [measure(server.create_database(f"w{n}"), _tenants(n), args.processes, args.concurrency,
                           args.seconds) for n in (1, 10)]
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    for r in results:
        print(f"{r['tenants']:>2} tenant(s): {r['events_per_s']:>8} events/s "
              f"({r['events']} events, {r['stored']} stored, last seqs sum {r['numbered']})")
    print(f"ten / one: {results[1]['events_per_s'] / max(1e-9, results[0]['events_per_s']):.2f}")


if __name__ == "__main__":
    main()
