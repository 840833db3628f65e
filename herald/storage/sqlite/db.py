"""SQLite access: one writer thread per process, reads on the event loop.

Why not aiosqlite (the stack's first choice): it runs every statement as its own hop to
its thread and shares one connection between all coroutines, so a multi-statement
transaction either holds a lock across several hops or interleaves with another
coroutine's statements. Herald's transactions (job + event + outbox + key) must be one
unit, so each runs as a single function on the writer thread: one hop per transaction.
Point reads (the status poll, the hot path) run directly on a separate read connection:
in WAL mode readers never wait for the writer, and a primary-key lookup is microseconds,
cheaper than any thread hop.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    # NORMAL in WAL survives any process crash (kill -9); only an OS crash or power
    # loss can drop the last commits. FULL would fsync every accept.
    "PRAGMA synchronous=NORMAL",
    "PRAGMA foreign_keys=ON",
)


def connect(path: Path, *, busy_timeout_ms: int = 10_000, check_same_thread: bool = True) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=check_same_thread)
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
    for pragma in PRAGMAS:
        conn.execute(pragma)
    return conn


class Database:
    """Owns the two connections to one SQLite file. ``open()`` and ``close()`` are safe to call twice
    (the job store and the webhook store share one Database)."""

    def __init__(self, path: Path, schema: str) -> None:
        self.path = path
        self.schema = schema
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-writer")
        self._writer: sqlite3.Connection | None = None
        self.reader: sqlite3.Connection | None = None
        self._closed = False

    async def open(self) -> None:
        if self._writer is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)

        def _open() -> None:
            self._writer = connect(self.path, check_same_thread=False)
            self._writer.executescript(self.schema)  # CREATE ... IF NOT EXISTS: safe from many processes

        await asyncio.get_running_loop().run_in_executor(self._executor, _open)
        self.reader = connect(self.path, busy_timeout_ms=2_000)

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` as one IMMEDIATE transaction on the writer thread."""

        def _tx() -> T:
            conn = self._writer
            assert conn is not None, "database is closed"
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result

        return await asyncio.get_running_loop().run_in_executor(self._executor, _tx)

    async def read_in_thread(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """For scans too long to run on the event loop (sweeps, retention)."""

        def _read() -> T:
            assert self._writer is not None, "database is closed"
            return fn(self._writer)

        return await asyncio.get_running_loop().run_in_executor(self._executor, _read)

    def read(self, sql: str, params: tuple | list = ()) -> list[sqlite3.Row]:
        assert self.reader is not None, "database is closed"
        return self.reader.execute(sql, params).fetchall()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self._writer is not None:
            writer, self._writer = self._writer, None
            await asyncio.get_running_loop().run_in_executor(self._executor, writer.close)
        self._executor.shutdown(wait=True)
