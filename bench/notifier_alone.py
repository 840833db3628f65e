"""The notifier's CPU and write transactions per delivered job, with nothing else running.

``python -m bench.notifier_alone [--jobs 1500] [--batch 0|3|40...] [--rounds 1]``

Echo-like jobs (accepted in the store first, not counted) whose three events (queued,
running, succeeded) are handed straight to the notifier's fan-out (``Scheduler.fan_out``;
no NATS), one endpoint subscribed to ``job.succeeded`` on a receiver in another process;
measured until every job's webhook is delivered. ``--batch``: jobs per fan-out batch (0: one
event per batch, as an idle notifier gets them; a busy one gets a few jobs' worth per fetch).
CPU is this process's (the loop, the SQLite writer thread), which the machine's other load
moves far less than a rate; the writes are the transactions the notifier's ``Database`` was
asked for, per job. Issue 24 (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bench.procs import free_port

_RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Receiver(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Receiver).serve_forever()
"""


async def _run(jobs_n: int, batch_jobs: int) -> tuple[float, dict[str, float]]:
    from herald.jobs import NewJob
    from herald.metrics import metrics
    from herald.sealing import Sealer
    from herald.storage.sqlite.db import Database
    from herald.storage.sqlite.jobs import SqliteJobStore
    from herald.storage.sqlite.queue import SqliteDeliveryQueue
    from herald.storage.sqlite.schema import SCHEMA
    from herald.storage.sqlite.webhooks import SqliteWebhookStore
    from notifier.delivery import Sender
    from notifier.retry import RetryPolicy
    from notifier.scheduler import Scheduler
    from schemas import JobEvent

    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(port)])
    root = Path(tempfile.mkdtemp(prefix="herald-notifier-alone-"))
    sealer = Sealer([secrets.token_urlsafe(32)])
    gateway_db = Database(root / "herald.db", SCHEMA)
    jobs = SqliteJobStore(gateway_db, retention_s=3600, sealer=sealer)
    await jobs.open()
    await SqliteWebhookStore(gateway_db, sealer).create_endpoint(
        "acme", url=f"http://127.0.0.1:{port}/hook", event_types=["job.succeeded"], kinds=None,
        signature="hmac-sha256")
    events: list[JobEvent] = []
    for n in range(jobs_n):
        queued = (await jobs.accept(NewJob(id=f"job{n}", tenant="acme", kind="echo", collection="/echoes",
                                           params=b"{}", deadline_s=600))).event
        assert queued is not None
        events.append(queued)
        for step, type in ((1, "job.running"), (2, "job.succeeded")):
            data = msgspec.json.encode({"id": queued.job_id, "version": queued.version + step, "state": type})
            events.append(JobEvent(seq=queued.seq + step, tenant=queued.tenant, job_id=queued.job_id,
                                   kind=queued.kind, version=queued.version + step, type=type, at=queued.at,
                                   data=msgspec.Raw(data)))
    db = Database(root / "herald.db", SCHEMA)
    await db.open()
    writes: Counter[str] = Counter()
    write = db.write

    async def counted(fn: Callable[[Any], Any]) -> Any:
        writes[fn.__qualname__.split(".")[1]] += 1
        return await write(fn)

    db.write = counted  # type: ignore[method-assign]
    queue = SqliteDeliveryQueue(db, sealer)
    try:
        async with Sender(allow_private=True) as sender:
            scheduler = Scheduler(queue, sender, RetryPolicy(schedule=(1.0,), min_backoff_s=1.0), metrics(),
                                  idle_poll_s=0.2, retention_s=3600)
            run = asyncio.create_task(scheduler.run())
            await asyncio.sleep(0.5)  # its first pass (retention) out of the way
            writes.clear()
            step = 3 * batch_jobs if batch_jobs else 1
            started = time.process_time()
            fan_out = getattr(scheduler, "fan_out", None)  # None: a tree before the leasing fan-out
            for i in range(0, len(events), step):
                if fan_out is not None:
                    await fan_out(events[i:i + step])
                elif await queue.fan_out(events[i:i + step]):
                    scheduler.kick()
                await asyncio.sleep(0)
            while db.read("SELECT COUNT(*) FROM webhook_deliveries WHERE status = 'delivered'")[0][0] < jobs_n:
                await asyncio.sleep(0.02)
            cpu = time.process_time() - started
            scheduler.stop()
            await run
    finally:
        await db.close()
        await jobs.close()
        receiver.terminate()
    writes.pop("prune", None)
    return 1000 * cpu / jobs_n, {name: round(n / jobs_n, 2) for name, n in writes.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.notifier_alone", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1500)
    parser.add_argument("--batch", type=int, action="append", help="jobs per fan-out batch (0: one event)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    for round_n in range(1, args.rounds + 1):
        for batch in args.batch or [0, 3, 40]:
            cpu_ms, writes = asyncio.run(_run(args.jobs, batch))
            print(f"round {round_n} batch {batch}: {cpu_ms:.3f} ms CPU per job, writes per job "
                  f"{sum(writes.values()):.2f} {writes}", flush=True)


if __name__ == "__main__":
    main()
