"""The PostgreSQL server of a ``--store postgres`` run: one ``launcher.pgserver.PostgresServer``
in the run's temp dir, on a free port, started on first use and stopped when the run ends.

Every Herald deployment of the run gets a database of its own (``database()``), so no
scenario sees another's rows, as every SQLite deployment has a file of its own. The server
runs with ``PostgresServer``'s settings, the ones ``herald up --cluster`` runs with (fsync
and synchronous commit on), plus ``track_wal_io_timing`` (so a run says how long its WAL
writes and flushes took: two clock reads each) and ``--pg-set`` what-ifs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from bench.procs import free_port
from launcher.pgserver import PostgresServer


class BenchPostgres:
    def __init__(self, data_dir: Path, settings: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.settings = {"track_wal_io_timing": "on", **(settings or {})}
        self.server: PostgresServer | None = None
        self.created: list[str] = []
        self.start_s = 0.0

    def _started(self) -> PostgresServer:
        if self.server is None or not self.server.running:
            started = time.monotonic()
            self.server = PostgresServer(self.data_dir, port=free_port(), settings=self.settings)
            self.server.start()
            self.start_s = round(time.monotonic() - started, 1)
        return self.server

    def database(self, label: str) -> str:
        """A fresh, empty database for one deployment; returns its URL."""
        server = self._started()
        base = re.sub(r"[^a-z0-9_]", "_", label.lower())[:40] or "herald"
        name = f"{base}_{len(self.created) + 1}"
        self.created.append(name)
        return server.create_database(name)

    @property
    def version(self) -> str:
        server = self._started()
        return server.psql("SHOW server_version").strip()

    def describe(self) -> dict[str, object]:
        if self.server is None:
            return {}
        return {"version": self.version, "port": self.server.port, "settings": self.server.settings,
                "databases": len(self.created), "start_s": self.start_s}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


WAITS_SQL = """
SELECT coalesce(wait_event_type, 'CPU') AS type, coalesce(wait_event, '-') AS event,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 60) AS query
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
  AND state = 'active'
"""


COUNTERS_SQL = """
SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()) AS commits,
       (SELECT coalesce(sum(fsyncs), 0) FROM pg_stat_io WHERE object = 'wal') AS wal_fsyncs,
       (SELECT coalesce(sum(fsync_time), 0) FROM pg_stat_io WHERE object = 'wal') AS wal_fsync_ms,
       (SELECT coalesce(sum(write_time), 0) FROM pg_stat_io WHERE object = 'wal') AS wal_write_ms,
       (SELECT wal_records FROM pg_stat_wal) AS wal_records,
       (SELECT wal_bytes FROM pg_stat_wal) AS wal_bytes
"""

# Calls of Herald's functions and the time spent in them (total_time: nested calls included):
# counted only with --pg-set track_functions=pl.
CALLS_SQL = "SELECT funcname, calls, total_time FROM pg_stat_user_functions WHERE funcname LIKE 'herald%'"


class PgWaits:
    """What the database's sessions are doing while a phase runs: ``pg_stat_activity`` sampled
    every ``interval`` s from a thread of its own, counted by (wait event, statement). A
    session waiting for ``Lock/transactionid`` waits for another transaction's row lock;
    ``IO/WalSync`` and ``LWLock/WALWrite`` are commits waiting for the WAL flush; ``CPU`` is
    running. ``with PgWaits(url) as waits: ...`` then ``waits.summary()``; ``url=None``: no-op.

    Also what the server did meanwhile (``counted()``): the database's commits (read-only
    ones included), and the server's WAL fsyncs, records and bytes (every database's: the
    run's server serves one deployment at a time). A backend reports its counts at most
    once a second, so a phase of several seconds is needed for these to mean much."""

    def __init__(self, url: str | None, interval: float = 0.05) -> None:
        import threading
        from collections import Counter

        self.url = url
        self.interval = interval
        self.counts: Counter[tuple[str, str]] = Counter()
        self.samples = 0
        self.busy_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-waits", daemon=True)
        self.error: str | None = None
        self.counters: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.call_ms: dict[str, float] = {}

    def __enter__(self) -> PgWaits:
        if self.url:
            self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        import asyncio

        try:
            asyncio.run(self._sample())
        except Exception as exc:  # a sampler must never break the measurement
            self.error = f"{type(exc).__name__}: {exc}"

    async def _sample(self) -> None:
        import asyncio

        import asyncpg

        assert self.url is not None
        conn = await asyncpg.connect(self.url)
        try:
            first = dict(await conn.fetchrow(COUNTERS_SQL))
            first_calls = {r["funcname"]: (r["calls"], r["total_time"]) for r in await conn.fetch(CALLS_SQL)}
            while not self._stop.is_set():
                rows = await conn.fetch(WAITS_SQL)
                self.samples += 1
                if rows:
                    self.busy_samples += 1
                for row in rows:
                    self.counts[(f"{row['type']}/{row['event']}", row["query"])] += 1
                await asyncio.sleep(self.interval)
            await asyncio.sleep(1.1)  # the backends' last reports
            last = dict(await conn.fetchrow(COUNTERS_SQL))
            self.counters = {name: float(last[name] - first[name]) for name in first}
            for r in await conn.fetch(CALLS_SQL):
                calls, ms = first_calls.get(r["funcname"], (0, 0.0))
                self.calls[r["funcname"]] = r["calls"] - calls
                self.call_ms[r["funcname"]] = r["total_time"] - ms
        finally:
            await conn.close()

    def summary(self, top: int = 8) -> dict[str, object]:
        """Session-samples by wait event (share of all), and the top (wait, statement) pairs."""
        total = sum(self.counts.values())
        by_wait: dict[str, int] = {}
        for (wait, _query), n in self.counts.items():
            by_wait[wait] = by_wait.get(wait, 0) + n
        share = (lambda n: round(100 * n / total, 1)) if total else (lambda n: 0.0)
        return {
            "samples": self.samples,
            "mean_active_sessions": round(total / self.samples, 2) if self.samples else 0.0,
            "by_wait_pct": {w: share(n) for w, n in sorted(by_wait.items(), key=lambda kv: -kv[1])},
            "top": [{"wait": w, "statement": q, "pct": share(n)} for (w, q), n in self.counts.most_common(top)],
            **({"error": self.error} if self.error else {}),
        }

    def per(self, jobs: int) -> dict[str, float]:
        """The counters divided by ``jobs`` (commits, WAL fsyncs and records per job, WAL kB per job)."""
        if not jobs or not self.counters:
            return {}
        per = {name: round(value / jobs, 2) for name, value in self.counters.items()
               if name not in ("wal_bytes", "wal_fsync_ms", "wal_write_ms")}
        per["wal_kb"] = round(self.counters["wal_bytes"] / jobs / 1024, 2)
        fsyncs = self.counters.get("wal_fsyncs", 0.0)
        if fsyncs:  # the mean flush, and the WAL's write() per flush, in ms
            per["ms_per_wal_fsync"] = round(self.counters.get("wal_fsync_ms", 0.0) / fsyncs, 3)
            per["write_ms_per_wal_fsync"] = round(self.counters.get("wal_write_ms", 0.0) / fsyncs, 3)
        per.update({f"calls {name}": round(n / jobs, 2) for name, n in sorted(self.calls.items()) if n})
        per.update({f"ms in {name}": round(ms / jobs, 3) for name, ms in sorted(self.call_ms.items()) if ms})
        return per

    def note(self) -> str:
        """One line for the outcome's notes."""
        s = self.summary(top=3)
        waits = ", ".join(f"{w} {p:.0f} %" for w, p in list(s["by_wait_pct"].items())[:4])  # type: ignore[union-attr]
        return f"PostgreSQL sessions ({s['mean_active_sessions']} active on average): {waits}"
