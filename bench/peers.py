"""Herald's peers on the same trivial job: Celery + Redis and arq, two worker processes each.

``python -m bench --only e2e --peers`` runs them in the same run as Herald's end-to-end
burst, with the same number of jobs, and reports Herald's rate as a ratio of theirs.

* Redis: Debian's ``redis-server`` (``make bench-deps`` installs it), started by the bench
  on a free port in its temp dir, with the append-only file fsynced every second
  (``appendonly yes``, ``appendfsync everysec``, no RDB snapshots): durable to the last
  second, as Herald's SQLite store is (WAL, ``synchronous=NORMAL``) to the last commits.
* Celery (``bench/peer_tasks.py``): Redis as broker and result backend, JSON, one
  ``celery worker`` with its default prefork pool at ``--concurrency 2`` (two worker
  processes under one parent), its default log level.
* arq: two ``arq bench.peer_tasks.ArqSettings`` processes, arq's defaults (10 jobs at
  once each, results kept an hour, a log line per job).

What is measured, for each peer: a producer process (``python -m bench.peers``) sends one
warm-up job and waits for its result, then enqueues ``count`` jobs as fast as it can
(Celery: ``echo.delay(i)`` in a loop; arq: ``enqueue_job`` with 16 in flight, as Herald's
16 connections) and polls Redis for their results. The rate is jobs ÷ (last result
stored - first enqueue), "stored" being the time the worker wrote into the result
(Celery's ``date_done``, arq's ``finish_time``); CPU per job is the CPU of redis-server
and every worker process over the burst ÷ jobs (the producer's own CPU is reported
apart, as Herald's load generator's is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.procs import BenchError, CpuMeter, Proc, Procs, free_port, listening, wait_until
from bench.systems import clean_env

PEERS = ("celery", "arq")
NAMES = {"celery": "Celery + Redis", "arq": "arq"}
INSTALL_HINT = "install it with `make bench-deps` (or `apt-get install -y redis-server`)"
IN_FLIGHT = 16  # arq's producer: enqueues awaiting Redis at once (Herald's load: 16 connections)
POLL_S = 0.1


def redis_server() -> str | None:
    return shutil.which("redis-server")


def missing() -> str | None:
    """Why the peers cannot run here, or None."""
    if redis_server() is None:
        return f"redis-server is not installed; {INSTALL_HINT}"
    try:
        import arq  # noqa: F401
        import celery  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed: pip install -e '.[bench]'"
    return None


class Redis:
    """A redis-server of the bench's own: a free port, a dir in the run's temp dir, AOF fsynced every second."""

    def __init__(self, procs: Procs, root: Path, name: str = "redis") -> None:
        binary = redis_server()
        if binary is None:
            raise BenchError(f"redis-server not found; {INSTALL_HINT}")
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(root), "--daemonize", "no",
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--protected-mode", "no",
                "--loglevel", "warning"]
        self.proc = procs.spawn(name, argv, clean_env())
        wait_until(lambda: listening(self.port), timeout=15, what="redis-server listening", proc=self.proc)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _workers(procs: Procs, peer: str, env: dict[str, str], prefix: str) -> list[Proc]:
    if peer == "celery":
        argv = [sys.executable, "-m", "celery", "-A", "bench.peer_tasks", "worker", "--concurrency", "2",
                "--pool", "prefork", "--hostname", f"{prefix}@%h"]
        return [procs.spawn(f"{prefix}-celery-worker", argv, env)]
    argv = [sys.executable, "-m", "arq", "bench.peer_tasks.ArqSettings"]
    return [procs.spawn(f"{prefix}-arq-worker{i}", argv, env) for i in range(2)]


def run(procs: Procs, root: Path, peer: str, count: int, timeout_s: float) -> dict[str, Any]:
    """One peer's burst of ``count`` trivial jobs on a fresh Redis: rate, CPU per job."""
    redis = Redis(procs, root / peer / "redis", name=f"peer-{peer}-redis")
    env = clean_env(BENCH_REDIS_URL=redis.url, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    workers = _workers(procs, peer, env, f"peer-{peer}")
    meters = {"redis": redis.proc, **{w.name.rsplit("-", 1)[-1]: w for w in workers}}
    producer = subprocess.Popen([sys.executable, "-m", "bench.peers", peer, "--count", str(count),
                                 "--timeout", str(timeout_s)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=env["PYTHONPATH"])
    # The producer says "warm" once its warm-up job came back (the workers are up): the meter starts then.
    assert producer.stdout is not None
    line = producer.stdout.readline()
    if line.strip() != b"warm":
        producer.kill()
        _, err = producer.communicate()
        raise BenchError(f"the {peer} producer failed: {line.decode()}{err.decode()[-2000:]}")
    meter = CpuMeter(meters).start()
    try:
        out, err = producer.communicate(timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        producer.kill()
        raise BenchError(f"the {peer} producer did not finish in {timeout_s + 60:g} s") from None
    cpu = meter.stop()
    if producer.returncode != 0:
        raise BenchError(f"the {peer} producer exited {producer.returncode}: {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    wall = result["last_result"] - result["first_enqueue"]
    completed = result["completed"]
    result.update({
        "peer": NAMES[peer], "workers": "celery worker --pool prefork --concurrency 2" if peer == "celery"
        else "2 arq worker processes (max_jobs 10 each)",
        "jobs_per_s": round(completed / wall, 1) if wall > 0 and completed else 0.0,
        "cpu_pct": cpu,
        "cpu_ms_per_job": cpu_ms_per_job(meter, completed),
    })
    for proc in [*workers, redis.proc]:
        procs.stop(proc)
    return result


def cpu_ms_per_job(meter: CpuMeter, jobs: int) -> dict[str, float]:
    """Each metered process's CPU over the meter's span ÷ jobs, in ms, and their ``total``."""
    if not jobs:
        return {}
    per = {name: round(1000 * seconds / jobs, 2) for name, seconds in meter.seconds.items()}
    per["total"] = round(sum(per.values()), 2)
    return per


# ----- the producers (python -m bench.peers celery|arq --count N), one process each -------------


def _celery(count: int, timeout_s: float) -> dict[str, Any]:
    import redis

    from bench.peer_tasks import REDIS_URL, echo

    echo.delay(0).get(timeout=timeout_s)  # the workers are up and connected
    print("warm", flush=True)
    first = time.time()
    ids = [echo.delay(i).id for i in range(count)]
    enqueued = time.time()
    expected = {job_id: i for i, job_id in enumerate(ids)}
    client = redis.Redis.from_url(REDIS_URL)
    pending, last, failed = list(ids), 0.0, 0
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        values = client.mget([f"celery-task-meta-{job_id}" for job_id in pending])
        still = []
        for job_id, value in zip(pending, values):
            if value is None:
                still.append(job_id)
                continue
            meta = json.loads(value)
            if meta["status"] == "SUCCESS" and meta["result"] == {"n": expected[job_id]}:
                last = max(last, datetime.fromisoformat(meta["date_done"]).timestamp())
            else:
                failed += 1
        pending = still
        if pending:
            time.sleep(POLL_S)
    return {"jobs": count, "completed": count - len(pending) - failed, "failed": failed, "first_enqueue": first,
            "enqueued": enqueued, "last_result": last}


async def _arq(count: int, timeout_s: float) -> dict[str, Any]:
    from arq import create_pool
    from arq.connections import RedisSettings
    from arq.constants import result_key_prefix
    from arq.jobs import deserialize_result

    from bench.peer_tasks import REDIS_URL

    pool = await create_pool(RedisSettings.from_dsn(REDIS_URL))
    warm = await pool.enqueue_job("arq_echo", 0)
    assert warm is not None
    await warm.result(timeout=timeout_s)
    print("warm", flush=True)
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def enqueue(i: int) -> str:
        async with gate:
            job = await pool.enqueue_job("arq_echo", i)
            assert job is not None
            return job.job_id

    first = time.time()
    ids = await asyncio.gather(*(enqueue(i) for i in range(count)))
    enqueued = time.time()
    expected = {job_id: i for i, job_id in enumerate(ids)}
    pending, last, failed = list(ids), 0.0, 0
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        values = await pool.mget(*[result_key_prefix + job_id for job_id in pending])
        still = []
        for job_id, value in zip(pending, values):
            if value is None:
                still.append(job_id)
                continue
            info = deserialize_result(value)
            if info.success and info.result == {"n": expected[job_id]}:
                last = max(last, info.finish_time.timestamp())
            else:
                failed += 1
        pending = still
        if pending:
            await asyncio.sleep(POLL_S)
    await pool.aclose()
    return {"jobs": count, "completed": count - len(pending) - failed, "failed": failed, "first_enqueue": first,
            "enqueued": enqueued, "last_result": last}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description="a peer's producer (bench/peers.py)")
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.peer == "celery":
        result = _celery(args.count, args.timeout)
    else:
        result = asyncio.run(_arq(args.count, args.timeout))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["producer_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
