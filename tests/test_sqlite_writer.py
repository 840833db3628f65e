"""The SQLite writer (``herald.storage.sqlite.db.Database``) against a real file.

What the stores rely on: transactions queued together commit together, yet each stays
its own unit (one that raises leaves no trace and the others stand); a caller hears back
only once its writes are committed; processes sharing the file queue for it without
losing a write, also when one of them dies holding the write lock; and the WAL is copied
back into the database although no writer checkpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from herald.storage.migrations import Migration, Schema
from herald.storage.sqlite.db import Database
from tests.harness import wait_until

ITEMS = "CREATE TABLE items (n INTEGER PRIMARY KEY, writer TEXT NOT NULL);"
SCHEMA = Schema((Migration(1, "items", ITEMS),))


class Refused(Exception):
    pass


def _insert(n: int, *, refuse: bool = False):  # type: ignore[no-untyped-def]
    def tx(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO items (n, writer) VALUES (?, 'test')", (n,))
        if refuse:
            raise Refused(n)  # after writing: the savepoint must take the row back
        return n

    return tx


def _count(path: Path) -> set[int]:
    with sqlite3.connect(path) as conn:
        return {n for (n,) in conn.execute("SELECT n FROM items")}


async def test_a_batch_commits_together_and_a_refused_transaction_leaves_no_trace(tmp_path: Path) -> None:
    db = Database(tmp_path / "herald.db", SCHEMA)
    await db.open()
    try:
        results = await asyncio.gather(*(db.write(_insert(n, refuse=n % 7 == 0)) for n in range(1, 301)),
                                       return_exceptions=True)
    finally:
        await db.close()
    for n, result in zip(range(1, 301), results):
        if n % 7 == 0:
            assert isinstance(result, Refused) and result.args == (n,)
        else:
            assert result == n
    assert _count(tmp_path / "herald.db") == {n for n in range(1, 301) if n % 7}


async def test_a_write_that_may_wait_rides_with_the_next_batch_or_commits_alone(tmp_path: Path) -> None:
    """``write_soon`` (the relay's outbox deletes): committed with the next write, in the
    same commit; with no write coming, alone after ``RIDE_WAIT_S``; at close, before the
    writer closes."""
    path = tmp_path / "herald.db"
    db = Database(path, SCHEMA)
    await db.open()
    try:
        rider = db.write_soon(_insert(1))
        seen_before: list[bool] = []

        def after_rider(conn: sqlite3.Connection) -> int:
            seen_before.append(rider.done())
            return _insert(2)(conn)

        assert await db.write(after_rider) == 2
        assert rider.done() and await rider == 1, "the rider was answered with the batch it rode in"
        assert seen_before == [False], "and was in that batch, not committed before it"
        assert _count(path) == {1, 2}

        alone = db.write_soon(_insert(3))
        assert await asyncio.wait_for(alone, timeout=10) == 3  # no other write: committed by itself
        assert _count(path) == {1, 2, 3}
        refused = db.write_soon(_insert(4, refuse=True))
        with pytest.raises(Refused):
            await asyncio.wait_for(refused, timeout=10)
        last = db.write_soon(_insert(5))
    finally:
        await db.close()
    assert last.done() and last.result() == 5, "close commits what was still waiting"
    assert _count(path) == {1, 2, 3, 5}


async def test_a_caller_hears_back_only_after_its_commit(tmp_path: Path) -> None:
    path = tmp_path / "herald.db"
    db = Database(path, SCHEMA)
    await db.open()
    seen: list[bool] = []

    async def write_then_look(n: int) -> None:
        await db.write(_insert(n))
        seen.append(n in _count(path))  # another connection: only committed rows are visible to it

    try:
        await asyncio.gather(*(write_then_look(n) for n in range(1, 101)))
    finally:
        await db.close()
    assert seen == [True] * 100


async def test_a_failed_commit_fails_every_transaction_of_its_batch(tmp_path: Path) -> None:
    """A deferred foreign key is checked at COMMIT: the whole batch is refused, and said so to every caller."""
    schema = Schema((Migration(1, "items", ITEMS + """
        CREATE TABLE owners (id INTEGER PRIMARY KEY);
        CREATE TABLE pets (id INTEGER PRIMARY KEY,
            owner INTEGER NOT NULL REFERENCES owners (id) DEFERRABLE INITIALLY DEFERRED);
    """),))
    path = tmp_path / "herald.db"
    db = Database(path, schema)
    await db.open()

    def orphan(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO pets (id, owner) VALUES (1, 42)")

    try:
        results = await asyncio.gather(db.write(_insert(1)), db.write(orphan), db.write(_insert(2)),
                                       return_exceptions=True)
        after = await db.write(_insert(3))  # the writer goes on after a failed batch
    finally:
        await db.close()
    # Whether the three shared a batch depends on timing; each either committed or failed with the batch.
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed and all(isinstance(r, sqlite3.IntegrityError) for r in failed)
    assert after == 3
    assert _count(path) == {r for r in results if isinstance(r, int)} | {3}


WRITER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from herald.storage.migrations import Migration, Schema
    from herald.storage.sqlite.db import Database

    SCHEMA = Schema((Migration(1, "items", {schema!r}),))

    async def main(path: str, name: str, first: int, count: int) -> None:
        db = Database(Path(path), SCHEMA)
        await db.open()
        def insert(n):
            def tx(conn):
                conn.execute("INSERT INTO items (n, writer) VALUES (?, ?)", (n, name))
            return tx
        await asyncio.gather(*(db.write(insert(n)) for n in range(first, first + count)))
        await db.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
""")


def _run_writer(path: Path, name: str, first: int, count: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", WRITER.format(schema=ITEMS), str(path), name, str(first), str(count)],
                            stderr=subprocess.PIPE)


def test_processes_sharing_the_file_lose_no_write(tmp_path: Path) -> None:
    path = tmp_path / "herald.db"
    writers = [_run_writer(path, f"p{i}", 1 + i * 2000, 2000) for i in range(4)]
    for writer in writers:
        _out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err.decode()
    assert _count(path) == set(range(1, 8001))


HOLDER = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    from herald.storage.migrations import Migration, Schema
    from herald.storage.sqlite.db import Database

    async def main(path: str) -> None:
        db = Database(Path(path), Schema((Migration(1, "items", {schema!r}),)))
        await db.open()
        def hold(conn):
            print("holding", flush=True)
            time.sleep(600)  # inside the transaction, holding the write lock, until killed
        await db.write(hold)

    asyncio.run(main(sys.argv[1]))
""")


async def test_a_writer_killed_holding_the_lock_does_not_stop_the_others(tmp_path: Path) -> None:
    path = tmp_path / "herald.db"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(schema=ITEMS), str(path)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"holding\n"
        db = Database(path, SCHEMA)

        async def open_and_write() -> int:
            await db.open()  # opening writes too (the schema): it queues like any writer
            return await db.write(_insert(1))

        waiting = asyncio.ensure_future(open_and_write())
        try:
            done, _ = await asyncio.wait({waiting}, timeout=0.5)
            assert not done, "a second writer got in while the first held the lock"
            os.kill(holder.pid, signal.SIGKILL)
            assert await asyncio.wait_for(waiting, timeout=20) == 1
        finally:
            await db.close()
    finally:
        holder.kill()
        holder.wait()
    assert _count(path) == {1}


async def test_the_wal_is_checkpointed_although_no_writer_checkpoints(tmp_path: Path) -> None:
    path = tmp_path / "herald.db"
    db = Database(path, SCHEMA)
    await db.open()
    try:
        before = path.stat().st_size
        blob = "x" * 2000
        for n in range(1, 201):  # ~400 KB of pages into the WAL
            await db.write(lambda conn, n=n: conn.execute("INSERT INTO items (n, writer) VALUES (?, ?)", (n, blob)))
        # Only a checkpoint moves pages from the WAL into the database file itself.
        await asyncio.to_thread(wait_until, lambda: path.stat().st_size > before + 200_000, timeout=10,
                                what="the checkpointer to copy the WAL into the database")
    finally:
        await db.close()


@pytest.mark.parametrize("max_batch", [1, 8])
async def test_every_batch_size_gives_the_same_answers(tmp_path: Path, max_batch: int) -> None:
    db = Database(tmp_path / "herald.db", SCHEMA, max_batch=max_batch)
    await db.open()
    try:
        results = await asyncio.gather(*(db.write(_insert(n, refuse=n % 3 == 0)) for n in range(1, 61)),
                                       return_exceptions=True)
    finally:
        await db.close()
    assert [r if isinstance(r, int) else None for r in results] == [n if n % 3 else None for n in range(1, 61)]
    assert _count(tmp_path / "herald.db") == {n for n in range(1, 61) if n % 3}


async def test_one_process_checkpoints_and_another_takes_over_when_it_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "herald.db"
    blob = "x" * 2000

    async def fill(db: Database, first: int) -> None:
        for n in range(first, first + 200):
            await db.write(lambda conn, n=n: conn.execute("INSERT INTO items (n, writer) VALUES (?, ?)", (n, blob)))

    async def grows(size: int) -> None:
        await asyncio.to_thread(wait_until, lambda: path.stat().st_size > size + 200_000, timeout=10,
                                what="a checkpoint to copy the WAL into the database")

    first = Database(path, SCHEMA)
    await first.open()
    size = path.stat().st_size
    await fill(first, 1)
    await grows(size)  # only `first` is open: it holds the checkpointer's role
    second = Database(path, SCHEMA)
    await second.open()
    try:
        await first.close()
        size = path.stat().st_size
        await fill(second, 1000)
        await grows(size)  # `second` took the role over
    finally:
        await second.close()


async def test_a_batch_commits_on_the_loop_when_the_lock_is_free_and_waits_for_it_on_the_thread(tmp_path: Path) -> None:
    """A free write lock: the batch runs on the event loop itself (no hop to the writer
    thread and back). Held by another process: the batch waits for it on the writer thread,
    while the loop goes on, and commits once the lock is let go."""
    path = tmp_path / "herald.db"
    db = Database(path, SCHEMA)
    await db.open()
    loop_thread = threading.get_ident()
    ran_on: list[int] = []

    def insert_noting_thread(n: int):  # type: ignore[no-untyped-def]
        def tx(conn: sqlite3.Connection) -> int:
            ran_on.append(threading.get_ident())
            return _insert(n)(conn)
        return tx

    other = os.open(path.with_name(path.name + ".lock"), os.O_RDWR)  # its own open file: another holder
    try:
        assert await db.write(insert_noting_thread(1)) == 1
        assert ran_on == [loop_thread], "a free lock: committed on the loop"
        fcntl.flock(other, fcntl.LOCK_EX)
        waiting = asyncio.ensure_future(db.write(insert_noting_thread(2)))
        ticks = 0
        for _ in range(20):  # the loop is free while the write waits for the lock
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 20 and not waiting.done(), "a write got in while another holder had the lock"
        fcntl.flock(other, fcntl.LOCK_UN)
        assert await asyncio.wait_for(waiting, timeout=10) == 2
        assert len(ran_on) == 2 and ran_on[1] != loop_thread, "a held lock: waited for on the writer thread"
    finally:
        os.close(other)
        await db.close()
    assert _count(path) == {1, 2}


async def test_writes_queued_while_another_process_writes_commit_together_once_the_lock_is_free(
        tmp_path: Path) -> None:
    """While another process holds the write lock, every write this process queues joins one
    batch, committed once the lock comes free: the batch is taken when the lock is held, not
    before the wait. Taken before it, the first write committed alone and the rest waited for
    the lock again behind the same processes (a ``BEGIN``/``COMMIT`` and the WAL frames of the
    same pages once more for every wait: bench/RESULTS.md, issue 24)."""
    path = tmp_path / "herald.db"
    db = Database(path, SCHEMA)
    await db.open()
    begins: list[str] = []
    assert db._writer is not None
    db._writer.set_trace_callback(lambda sql: begins.append(sql) if sql.startswith("BEGIN") else None)
    other = os.open(path.with_name(path.name + ".lock"), os.O_RDWR)  # its own open file: another holder
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        writes = [asyncio.ensure_future(db.write(_insert(1)))]
        await asyncio.sleep(0.05)  # the first write's drain is on the writer thread, waiting for the lock
        for n in (2, 3, 4):
            writes.append(asyncio.ensure_future(db.write(_insert(n))))
            await asyncio.sleep(0.01)
        assert not any(write.done() for write in writes), "a write got in while another holder had the lock"
        fcntl.flock(other, fcntl.LOCK_UN)
        assert await asyncio.wait_for(asyncio.gather(*writes), timeout=10) == [1, 2, 3, 4]
        assert len(begins) == 1, f"four writes queued behind one holder took {len(begins)} transactions"
    finally:
        os.close(other)
        await db.close()
    assert _count(path) == {1, 2, 3, 4}


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads the open files from /proc")
async def test_a_transaction_committed_alone_writes_no_journal_file(tmp_path: Path) -> None:
    """A transaction function batched with others runs in a SAVEPOINT, whose journal SQLite
    moves to a temporary file past 64 KiB (opened, unlinked, written). Alone in its batch it
    needs none (if it raises, the whole transaction is rolled back): a notifier's fan-out
    nearly always runs alone, and its inserts cost a third less without the journal."""
    path = tmp_path / "herald.db"
    db = Database(path, SCHEMA)
    await db.open()

    def fill(conn: sqlite3.Connection) -> None:
        conn.executemany("INSERT INTO items (n, writer) VALUES (?, ?)", [(n, "x" * 2000) for n in range(200)])

    def temp_files_open_after_rewriting(conn: sqlite3.Connection) -> list[str]:
        # Row by row, as the stores write (a multi-row statement may keep a journal of its own).
        conn.executemany("UPDATE items SET writer = ? WHERE n = ?", [("y" * 2000, n) for n in range(200)])
        fds = Path("/proc/self/fd")
        return [target for target in (os.readlink(fds / fd) for fd in os.listdir(fds)
                                      if (fds / fd).is_symlink()) if "etilqs" in target]

    try:
        await db.write(fill)
        assert await db.write(temp_files_open_after_rewriting) == []
        with pytest.raises(Refused):
            await db.write(_insert(1000, refuse=True))  # alone, and refused: rolled back whole
        assert await db.write(_insert(1001)) == 1001
    finally:
        await db.close()
    assert 1000 not in _count(path) and 1001 in _count(path)


async def test_the_writer_thread_lets_the_lock_go_before_it_wakes_the_callers_loop(tmp_path: Path) -> None:
    """Waking the caller's loop from the writer thread gives the GIL up (the write to the loop's
    self-pipe), and the thread then waits for the woken loop to give it back: done under the
    write lock, every other writer of the file waited too, 170-300 us a transaction. The
    answers are queued under the lock, in commit order, and the loop is woken after it. Also
    two Databases on one loop (two processes' stores, as the store contract has them) are
    heard in the order they committed, whichever of them runs on the loop or the thread."""
    path = tmp_path / "herald.db"
    first, second = Database(path, SCHEMA), Database(path, SCHEMA)
    await first.open()
    await second.open()
    loop = asyncio.get_running_loop()
    # Whether the waking thread itself holds the write lock: the file's lock cannot say, as
    # the other Database's thread may take it the moment this one lets it go.
    holding = threading.local()
    for db in (first, second):
        def tracked(write_lock=db._write_lock):  # type: ignore[no-untyped-def]
            @contextlib.contextmanager
            def held():  # type: ignore[no-untyped-def]
                with write_lock():
                    holding.now = True
                    try:
                        yield
                    finally:
                        holding.now = False
            return held()
        db._write_lock = tracked  # type: ignore[method-assign]
    held_at_wake: list[bool] = []
    wake = loop.call_soon_threadsafe

    def noting_the_lock(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.get_ident() != threading.main_thread().ident:
            held_at_wake.append(getattr(holding, "now", False))
        return wake(callback, *args, **kwargs)

    loop.call_soon_threadsafe = noting_the_lock  # type: ignore[method-assign]
    heard: list[int] = []
    committed: list[int] = []  # in the order the transactions ran under the lock

    def insert_noting_order(n: int):  # type: ignore[no-untyped-def]
        def tx(conn: sqlite3.Connection) -> int:
            committed.append(n)
            return _insert(n)(conn)
        return tx

    async def write(db: Database, n: int) -> None:
        await db.write(insert_noting_order(n))
        heard.append(n)

    other = os.open(path.with_name(path.name + ".lock"), os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)  # both wait on their writer threads
        waiting = [asyncio.ensure_future(write(db, n)) for db, n in ((first, 1), (second, 2), (first, 3))]
        await asyncio.sleep(0.05)
        fcntl.flock(other, fcntl.LOCK_UN)
        await asyncio.wait_for(asyncio.gather(*waiting), timeout=10)
        await write(second, 4)  # on the loop, the lock free
    finally:
        del loop.call_soon_threadsafe
        os.close(other)
        await first.close()
        await second.close()
    assert held_at_wake and not any(held_at_wake), held_at_wake
    assert heard == committed, (heard, committed)
    assert _count(path) == {1, 2, 3, 4}
