"""SQLite access: writes on the event loop when the write lock is free, else on one writer
thread per process; reads on the event loop.

Why not aiosqlite (the stack's first choice): it runs every statement as its own hop to
its thread and shares one connection between all coroutines, so a multi-statement
transaction either holds a lock across several hops or interleaves with another
coroutine's statements. Herald's transactions (job + event + outbox + key) must be one
unit, so each runs as a single function, and the functions queued together commit as one
batch. A batch runs on the event loop itself when the write lock is free at that moment
(a commit in WAL mode with ``synchronous=NORMAL`` writes to the WAL and does not fsync: a
fraction of a millisecond); only when another process holds the lock does it go to the
writer thread, which waits for the lock there. On these machines a hop to a thread and
the answer back (a futex wake, a write to the loop's self-pipe, two context switches)
cost as much CPU as the transaction (bench/RESULTS.md, issue 24).
The writer thread wakes its callers' loop only after letting the write lock go (their
answers are queued under it, in commit order): the wake gives the GIL up and waits to get it
back, which under the lock held every process's writes up (``_queue_answer``).
Point reads (the status poll, the hot path) run directly on a separate read connection:
in WAL mode readers never wait for the writer, and a primary-key lookup is microseconds,
cheaper than any thread hop.

Two things SQLite leaves to its caller, done here because every process of a deployment
writes the same file:

* **Who writes next.** SQLite's busy handler polls for the write lock with sleeps of 1, 2,
  5, 10 ms..., so a lock freed after half a millisecond sits idle while its waiters sleep.
  Each write transaction first takes an exclusive ``flock`` on ``<db>.lock``: waiters block
  in the kernel and the next one runs the moment the lock is released (the kernel frees
  the lock of a process that dies, even by ``kill -9``).
* **When the WAL is checkpointed.** An automatic checkpoint runs in the committing
  connection after its COMMIT and fsyncs the WAL and the database: tens to hundreds of ms
  during which this process's writer thread, and every write queued behind it, waits.
  Writers therefore never checkpoint (``wal_autocheckpoint=0``); a checkpointer thread with
  its own connection does, every ``CHECKPOINT_INTERVAL_S`` (PASSIVE: it never blocks a
  writer or a reader, and copies only what no reader still needs). Every process has the
  thread, but only the one holding ``<db>.checkpoint`` (a non-blocking ``flock``) works;
  the others try again now and then and take over when that process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, TypeVar

from herald.jobs import StoreUnavailable
from herald.keyfiles import private_dir, private_file
from herald.storage.migrations import Function, Migration, Schema, migrate

T = TypeVar("T")

CHECKPOINT_INTERVAL_S = 0.25
# A write that may wait (``write_soon``) rides with the next batch, or runs on its own this
# long after it was asked for when no other write comes.
RIDE_WAIT_S = 0.05

# SQLite's primary result codes that say the file cannot be written now, not that the
# transaction is wrong: the disk is full, the filesystem went read-only or failed an I/O,
# the lock was not had within the busy timeout. Like a PostgreSQL connection lost, each
# is ``StoreUnavailable`` to the caller: a 503 with Retry-After at the gateway, a write
# tried again by a worker (its job is not failed for the disk's state), and once the
# operator frees space the same processes go on without a restart.
UNAVAILABLE_CODES = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR,
                               sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN})


def as_unavailable(error: BaseException) -> BaseException:
    """``error`` as the store's caller should see it: ``StoreUnavailable`` for a file that
    cannot be written now (``UNAVAILABLE_CODES``; extended codes carry the primary one in
    their low byte), else ``error`` itself."""
    code = getattr(error, "sqlite_errorcode", None)
    if isinstance(error, sqlite3.OperationalError) and code is not None and code & 0xFF in UNAVAILABLE_CODES:
        unavailable = StoreUnavailable(f"the SQLite store cannot be written now: {error}")
        unavailable.__cause__ = error
        return unavailable
    return error


# Below this much free space the data disk counts as full: SQLite's next WAL append or
# checkpoint fails, and /readyz says so before a request finds out.
MIN_FREE_BYTES = 1 << 20


def unwritable_reason(directory: Path) -> str | None:
    """Why a database in ``directory`` cannot be written now, as far as the filesystem says
    (read-only, or full), else None. One statvfs: cheap enough for every /readyz."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return "its directory cannot be read"
    if fs.f_flag & os.ST_RDONLY:
        return "its filesystem is read-only"
    # root may write into the blocks reserved for it, as SQLite running as root does
    free_blocks = fs.f_bfree if os.geteuid() == 0 else fs.f_bavail
    if free_blocks * fs.f_frsize < MIN_FREE_BYTES:
        return "its disk is full"
    return None


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
    (the job store and the webhook store share one Database).

    Writes are group-committed: every transaction function queued in the same turn of the
    loop, or while the writer thread waited for the lock or was busy, runs in the next
    ``BEGIN IMMEDIATE ... COMMIT`` (on the loop when the write lock is free, else on the
    writer thread), each inside its own ``SAVEPOINT`` (but a batch's only function, ``_alone``).
    A function that raises rolls back to its savepoint (its writes vanish, the others' stay)
    and its caller gets the exception; every caller is answered only after the batch has
    committed, so nothing is reported that is not durable. Each
    process takes the database-wide write lock once per batch instead of once per
    transaction: under load that lock, shared by every process, is Herald's ceiling.

    ``write_soon`` queues a transaction that need not commit now (the relay's outbox
    deletes): it rides in the next batch this process commits anyway, and only when none
    comes within ``RIDE_WAIT_S`` does it get a commit of its own.
    """

    def __init__(self, path: Path, schema: Schema, *, max_batch: int = 64, on_loop: bool = True) -> None:
        self.path = path
        self.schema = schema  # brought up to date when the database opens (herald.storage.sqlite.schema.SCHEMA)
        # This process's name on the outbox rows it commits: its relay publishes those.
        self.origin = secrets.token_hex(8)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-writer")
        self._writer: sqlite3.Connection | None = None
        self.reader: sqlite3.Connection | None = None
        self._closed = False
        self._max_batch = max_batch
        self._queue: deque[_Pending[Any]] = deque()
        self._riders: list[_Pending[Any]] = []  # write_soon: waiting for the next batch
        self._riders_due = False  # their wait is over: the next drain commits them, alone if need be
        self._queue_lock = threading.Lock()
        self._draining = False  # a drain owns the queue: scheduled on the loop, or on the writer thread
        # Whoever uses the writer connection holds this: the loop's drain (which only tries
        # it), the writer thread's jobs (drains, scans, open and close).
        self._writer_use = threading.Lock()
        self._on_loop = on_loop  # False: every batch on the writer thread (as before issue 24)
        self._lock_fd: int | None = None
        self._checkpointer: threading.Thread | None = None
        self._stop_checkpointing = threading.Event()
        self._opening: asyncio.Task[None] | None = None

    async def open(self) -> None:
        if self._opening is None:
            self._opening = asyncio.create_task(self._open(), name="sqlite-open")
        await self._opening  # a second caller (the stores share the Database) waits for the same open

    async def _open(self) -> None:
        private_dir(self.path.parent)

        def _open() -> None:
            private_file(self.path)  # before SQLite makes it (and its -wal, -shm alike) 0644
            self._lock_fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            writer = connect(self.path, check_same_thread=False)
            try:
                self._migrate(writer)
                writer.execute("PRAGMA wal_autocheckpoint=0")
            except BaseException:
                writer.close()
                raise
            self._writer = writer

        # One job on the writer thread: a write queued meanwhile runs after it, on the schema it made.
        await asyncio.get_running_loop().run_in_executor(self._executor, _open)
        self.reader = connect(self.path, busy_timeout_ms=2_000)
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="sqlite-checkpointer", daemon=True)
        self._checkpointer.start()

    def _migrate(self, writer: sqlite3.Connection) -> None:
        """Writer thread: the schema brought up to date in one transaction under the write lock
        (``herald.storage.migrations``); of several processes opening at once, the first
        migrates and the others find it done. The runner is a coroutine; here it only ever
        waits for this thread's own SQLite calls, so it runs on a loop of its own."""
        with self._write_lock():
            writer.execute("BEGIN IMMEDIATE")
            try:
                asyncio.run(migrate(_Session(writer), self.schema))
            except BaseException:
                writer.execute("ROLLBACK")
                raise
            writer.execute("COMMIT")

    @contextlib.contextmanager
    def _write_lock(self) -> Iterator[None]:
        assert self._lock_fd is not None
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _checkpoint_loop(self) -> None:
        """Checkpointer thread: copy the WAL back into the database, off every writer's path."""
        role = os.open(self.path.with_name(self.path.name + ".checkpoint"), os.O_RDWR | os.O_CREAT, 0o600)
        conn = connect(self.path, check_same_thread=False)
        try:
            conn.execute("PRAGMA busy_timeout=0")
            checkpointing = False
            while not self._stop_checkpointing.wait(CHECKPOINT_INTERVAL_S):
                if not checkpointing:
                    try:
                        fcntl.flock(role, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:  # another process checkpoints
                        continue
                    checkpointing = True
                with contextlib.suppress(sqlite3.Error):  # busy (a checkpoint by hand) or closing: next time
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        finally:
            conn.close()
            os.close(role)  # releases the role, if held

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` as one transaction (a savepoint of the next group commit), on the loop or the writer thread."""
        loop = asyncio.get_running_loop()
        pending: _Pending[T] = _Pending(fn, loop.create_future(), loop)
        with self._queue_lock:
            self._queue.append(pending)
            start = not self._draining
            self._draining = True
        if start:
            self._start_drain(loop)
        return await pending.future

    def _start_drain(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The queue has a drain now (``_draining`` was just set): on the loop, once the
        writes of this turn of the loop are queued too (they share the batch), or on the
        writer thread."""
        if loop is not None and self._on_loop:
            loop.call_soon(self._drain_on_loop)
        else:
            self._executor.submit(self._drain)

    def _drain_on_loop(self) -> None:
        """Loop: commit what is queued here if this process's writer and the database's write
        lock are both free now; else hand the drain to the writer thread, which waits for them."""
        if not self._writer_use.acquire(blocking=False):
            self._release_to_thread()  # a scan is using the writer: after it
            return
        try:
            if self._writer is None or self._lock_fd is None:  # not open yet, or closed
                self._release_to_thread()
                return
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process is writing: wait for it off the loop
                self._release_to_thread()
                return
            try:
                with self._queue_lock:
                    batch = self._take_batch()
                if batch:
                    _settle_queued(asyncio.get_running_loop())  # answers of earlier commits first
                    self._commit_locked(batch, _settle_now)
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            self._writer_use.release()
        with self._queue_lock:
            if not self._queue and not self._riders_due:
                self._draining = False
                return
        # More than a batch was queued (or riders fell due meanwhile): the rest in a later turn.
        asyncio.get_running_loop().call_soon(self._drain_on_loop)

    def _release_to_thread(self) -> None:
        """The writer thread drains: it opens the database first (its jobs run in order), or
        answers that the database is closed; once closed for good, answered here."""
        try:
            self._executor.submit(self._drain)
        except RuntimeError:  # the executor is shut down: nothing will drain the queue
            with self._queue_lock:
                batch = list(self._queue) + self._riders
                self._queue.clear()
                self._riders, self._riders_due, self._draining = [], False, False
            for pending in batch:
                _settle_now(pending, None, sqlite3.ProgrammingError("database is closed"))

    def _take_batch(self) -> list[_Pending[Any]]:
        """Under ``_queue_lock``: the next batch (riders go with any batch)."""
        batch, self._riders, self._riders_due = self._riders, [], False
        batch += [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]
        return batch

    def write_soon(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        """Run ``fn`` as one transaction of the next batch this process commits, or on its own
        ``RIDE_WAIT_S`` from now; the future is answered once it has committed."""
        if self._closed:
            raise sqlite3.ProgrammingError("database is closed")
        loop = asyncio.get_running_loop()
        pending: _Pending[T] = _Pending(fn, loop.create_future(), loop)
        with self._queue_lock:
            self._riders.append(pending)
            first = len(self._riders) == 1
        if first:
            loop.call_later(RIDE_WAIT_S, self._riders_wait_over)
        return pending.future

    def _riders_wait_over(self, *, on_loop: bool = True) -> None:
        with self._queue_lock:
            if not self._riders:  # they rode with a batch meanwhile
                return
            self._riders_due = True
            start = not self._draining
            self._draining = True
        if start:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: close() committed them
                self._start_drain(asyncio.get_running_loop() if on_loop else None)

    def _drain(self) -> None:
        """Writer thread: commit batches until the queue is empty (riders go with any batch)."""
        with self._writer_use:
            while True:
                with self._queue_lock:
                    if not self._queue and not self._riders_due:
                        self._draining = False
                        return
                self._commit_batch()

    def _commit_batch(self) -> None:
        """Writer thread: wait for the write lock, then commit what is queued by then as one
        batch, each caller answered through its loop.

        The batch is taken once the lock is held, not before the wait: what the loop queued
        while another process wrote joins it. Taken before, it waited for a lock of its own
        behind the same processes again, so a busy process paid a ``BEGIN``/``COMMIT`` and the
        WAL frames of the same hot pages once for every wait (bench/RESULTS.md, issue 24)."""
        batch: list[_Pending[Any]] = []
        if self._writer is None:
            with self._queue_lock:
                batch = self._take_batch()
            for pending in batch:
                pending.answer(None, sqlite3.ProgrammingError("database is closed"))
            return
        try:
            with self._write_lock():
                with self._queue_lock:
                    batch = self._take_batch()
                if not batch:
                    return
                self._commit_locked(batch, _queue_answer)
        except BaseException as exc:  # the lock itself failed
            if not batch:
                with self._queue_lock:
                    batch = self._take_batch()
            for pending in batch:
                pending.answer(None, exc)
            return
        _wake_for_answers(batch)  # the lock is let go first: the woken loop cannot keep it held

    def _commit_locked(self, batch: list[_Pending[Any]],
                       answer: Callable[[_Pending[Any], Any, BaseException | None], None]) -> None:
        """One ``BEGIN IMMEDIATE ... COMMIT`` of the batch, the write lock held by the caller."""
        conn = self._writer
        assert conn is not None
        outcomes: list[tuple[Any, BaseException | None]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if len(batch) == 1:
                    outcomes.append(_alone(conn, batch[0].fn))
                else:
                    for pending in batch:
                        outcomes.append(_in_savepoint(conn, pending.fn))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            if len(batch) == 1 and outcomes[0][1] is not None:  # alone and raised: nothing of it stands
                if conn.in_transaction:  # (an error SQLite itself rolled back leaves none open)
                    conn.execute("ROLLBACK")
            else:
                conn.execute("COMMIT")
        except BaseException as exc:  # BEGIN, COMMIT or a savepoint step failed: nothing of the batch stands
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            for pending in batch:
                answer(pending, None, exc)
            return
        # Answered (or, from the writer thread, queued for the loop) before the lock is let go:
        # so callers on one event loop hear of commits in the order they were made, even from
        # two Databases on one file (the store contract's "two processes").
        for pending, (result, error) in zip(batch, outcomes):
            answer(pending, result, error)

    async def read_in_thread(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """For scans too long to run on the event loop (sweeps, retention)."""

        def _read() -> T:
            with self._writer_use:
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
        self._riders_wait_over(on_loop=False)  # queued before the writer closes: the executor runs in order
        self._stop_checkpointing.set()
        if self._checkpointer is not None:
            await asyncio.to_thread(self._checkpointer.join)
            self._checkpointer = None
        # Queued behind any batch still pending: the executor runs one job at a time, in order.
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close_writer)
        self._executor.shutdown(wait=True)

    def _close_writer(self) -> None:
        with self._writer_use:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None


class _Session:
    """The migration runner's view of the writer connection (``herald.storage.migrations.Session``)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str) -> None:
        # Statement by statement: executescript would COMMIT the open transaction first.
        for statement in statements(sql):
            self._conn.execute(statement)

    async def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self._conn.execute(sql)]

    async def record(self, migration: Migration) -> None:
        self._conn.execute(
            "INSERT INTO herald_schema_migrations (version, name, checksum, applied_at) VALUES (?, ?, ?, ?)",
            (migration.version, migration.name, migration.checksum, time.time()))

    async def record_function(self, function: Function) -> None:
        self._conn.execute(
            "INSERT INTO herald_schema_functions (name, checksum, applied_at) VALUES (?, ?, ?)"
            " ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, applied_at = excluded.applied_at",
            (function.name, function.checksum, time.time()))


def statements(script: str) -> Iterator[str]:
    """The statements of an SQL script, each whole: split at every ``;`` that ends one
    (``sqlite3.complete_statement`` knows string literals, comments and trigger bodies)."""
    pending = ""
    *pieces, tail = script.split(";")
    for piece in pieces:
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            yield pending
            pending = ""
    if (pending + tail).strip():
        yield pending + tail  # no closing ";": SQLite takes it as it takes a last statement


def _alone(conn: sqlite3.Connection,
           fn: Callable[[sqlite3.Connection], T]) -> tuple[T | None, BaseException | None]:
    """Run the only transaction function of a batch; if it raises, its caller rolls the whole
    transaction back, so it needs no savepoint.

    A savepoint's journal (the pages it changed, as they were) moves to a temporary file past
    64 KiB: a notifier's fan-out of a few jobs, eight B-trees per delivery, nearly always
    passed it, and each of its inserts cost three times as much (bench/RESULTS.md, issue 24).
    The notifier's transactions nearly always commit alone. Kept in memory instead
    (``temp_store=MEMORY``) the journal would have no bound: a dead endpoint's backlog failed
    in one statement would need all its pages in RAM."""
    try:
        return fn(conn), None
    except Exception as exc:
        return None, exc


def _in_savepoint(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> tuple[T | None, BaseException | None]:
    """Run one caller's transaction function; on an exception undo only its own writes."""
    conn.execute("SAVEPOINT herald_tx")
    try:
        result = fn(conn)
    except Exception as exc:
        conn.execute("ROLLBACK TO herald_tx")
        conn.execute("RELEASE herald_tx")
        return None, exc
    conn.execute("RELEASE herald_tx")
    return result, None


class _Pending(Generic[T]):
    """One queued transaction function and the future its caller awaits on the loop."""

    __slots__ = ("fn", "future", "loop")

    def __init__(self, fn: Callable[[sqlite3.Connection], T], future: asyncio.Future[T],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.future = future
        self.loop = loop

    def answer(self, result: Any, error: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


# The writer threads' answers, per caller's loop, in commit order. A writer thread queues a
# batch's answers while it holds the write lock (so that, across Databases, they stay in commit
# order) and wakes the loop only after letting the lock go. Waking it under the lock
# (``call_soon_threadsafe``) cost 170-300 us of lock time per transaction: the thread gives the
# GIL up for the write to the loop's self-pipe and waits to get it back from the woken loop
# (bench/RESULTS.md, issue 24).
_queued_answers: dict[asyncio.AbstractEventLoop, deque[tuple[asyncio.Future[Any], Any, BaseException | None]]] = {}


def _queue_answer(pending: _Pending[Any], result: Any, error: BaseException | None) -> None:
    """Writer thread, under the write lock: the answer waits in its loop's queue."""
    answers = _queued_answers.get(pending.loop)
    if answers is None:
        answers = _queued_answers.setdefault(pending.loop, deque())
    answers.append((pending.future, result, error))


def _wake_for_answers(batch: list[_Pending[Any]]) -> None:
    """Writer thread, the lock let go: each loop with answers settles its queue."""
    for loop in {pending.loop for pending in batch}:
        try:
            loop.call_soon_threadsafe(_settle_queued, loop)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            _queued_answers.pop(loop, None)


def _settle_queued(loop: asyncio.AbstractEventLoop) -> None:
    """On ``loop``: settle its queued answers in the order they were queued."""
    answers = _queued_answers.get(loop)
    while answers:
        future, result, error = answers.popleft()
        _settle(future, result, error)


def _settle_now(pending: _Pending[Any], result: Any, error: BaseException | None) -> None:
    """On the caller's own loop: no hop through ``call_soon_threadsafe`` (a caller on another
    loop, which Herald never has, is answered through its own)."""
    if pending.loop is asyncio.get_running_loop():
        _settle(pending.future, result, error)
    else:
        pending.answer(result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled; the transaction stands (or not) all the same
        return
    if error is not None:
        future.set_exception(as_unavailable(error))
    else:
        future.set_result(result)
