"""PostgreSQL access: one asyncpg pool per process, the schema migrated under an advisory lock.

Every process (gateway, worker, notifier) may run on its own machine, so nothing here
relies on local state: times come from the server's clock (``clock_timestamp()``), the
schema (``herald.storage.migrations``) is created or upgraded by whichever process gets the
advisory lock first (the others wait on it, then find nothing left to do), and an
unreachable server is retried with a log line naming ``HERALD_DATABASE_URL`` instead of
crashing the process.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg

from herald.jobs import StoreUnavailable
from herald.storage.migrations import Function, Migration, Schema, migrate

log = logging.getLogger("herald.postgres")

MAX_GROUP = 64  # statements per group commit
# Group commits of one process under way at once, each on a connection of its own. With one,
# a statement queued while a batch waited for its WAL flush waited for that flush, then for
# its own: on a loaded server a flush takes milliseconds (the e2e bench: 1.5 ms an fsync, 58 %
# of the sessions' time waiting on the WAL), so a gateway's accept took about two of them,
# and 16 connections each waiting for a 202 went at 16 over that. With two, the next batch
# is sent while the last one flushes, and the server's own group commit lets their flushes
# share one fsync. Deadlocks stay as unlikely as between two processes' batches, which
# already run at once: every batch takes its rows in the same ``order``.
BATCHES_IN_FLIGHT = 2

# pg_advisory_xact_lock key for schema migrations ("HERALD" in ASCII, as a bigint).
MIGRATION_LOCK = 0x48455241_4C44
# The server's clock in Unix seconds, as every stored time is.
NOW_SQL = "extract(epoch from clock_timestamp())::double precision"

CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.ConnectionFailureError,
    # The first statement on a pooled connection whose server shut down while it sat idle:
    # asyncpg's protocol refuses it ("cannot switch to state ...") before noticing the
    # socket is gone, and the pool replaces the connection.
    asyncpg.exceptions.InternalClientError,
    TimeoutError,
)


T = TypeVar("T")


def unavailable_on_connection_errors(cls: type[T]) -> type[T]:
    """Every public coroutine method of a store answers a lost or refused connection with
    ``StoreUnavailable`` (a 503 with Retry-After at the gateway), never a driver error that
    would surface as a 500: the client can outwait a database that is restarting."""
    for name, method in list(vars(cls).items()):
        if name.startswith("_") or not inspect.iscoroutinefunction(method):
            continue

        def guarded(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            @functools.wraps(method)
            async def call(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await method(*args, **kwargs)
                except CONNECTION_ERRORS as exc:
                    raise StoreUnavailable(f"the PostgreSQL store is not reachable (HERALD_DATABASE_URL): {exc}") from exc

            return call

        setattr(cls, name, guarded(method))
    return cls


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """No reset query when a connection goes back to the pool (asyncpg's default costs a
    round trip per use). Herald leaves no session state behind: its advisory locks are
    transaction-scoped, its settings function-scoped (``SET`` clauses) or fixed for the
    session's life (``herald.origin``), no LISTEN, no cursors."""


class _Grouped:
    """One statement waiting for the next group commit, and the future its caller awaits."""

    __slots__ = ("sql", "args", "row", "order", "future")

    def __init__(self, sql: str, args: tuple[Any, ...], *, row: bool, order: str = "") -> None:
        self.sql = sql
        self.args = args
        self.row = row
        self.order = order
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def run(self, conn: asyncpg.Connection) -> Any:
        if self.row:
            return await conn.fetchrow(self.sql, *self.args)
        return await conn.fetchval(self.sql, *self.args)

    def settle(self, value: Any, error: BaseException | None) -> None:
        if self.future.done():  # the caller gave up (cancelled); the statement stands or not all the same
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)


class _Combined(_Grouped):
    """Statements that are each one function call (``SELECT f($1, ...)``), sent as one: ``SELECT
    f($1, ...) AS r0, g($23, ...) AS r1, ...``, evaluated left to right (the batch's lock order)
    in one implicit transaction: one round trip and one send for the batch, no ``BEGIN`` or
    ``COMMIT``. If it fails, each is run again alone (``_one_by_one``)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[_Grouped]) -> None:
        calls: list[str] = []
        args: list[Any] = []
        for i, part in enumerate(parts):
            match = _ONE_CALL.match(part.sql)
            assert match is not None
            shift = len(args)
            calls.append(_PARAM.sub(lambda m: f"${int(m.group(1)) + shift}", match.group(1)) + f" AS r{i}")
            args.extend(part.args)
        super().__init__("SELECT " + ", ".join(calls), tuple(args), row=True, order=parts[0].order)
        self.parts = parts

    def settle(self, value: Any, error: BaseException | None) -> None:
        for i, part in enumerate(self.parts):
            part.settle(None if error is not None else value[i], error)


# A statement that is one call of one of Herald's functions with positional parameters.
_ONE_CALL = re.compile(r"^SELECT (herald_[a-z_]+\((?:\$\d+(?:, )?)*\))$")
_PARAM = re.compile(r"\$(\d+)")


def _combinable(batch: list[_Grouped]) -> bool:
    return len(batch) > 1 and all(not s.row and _ONE_CALL.match(s.sql) for s in batch)


def _lock_order(statement: _Grouped) -> str:
    return statement.order


class _Rider:
    """Writes that ride in the next batch (``ride``): one statement with one array parameter
    (``{}`` in its text), the arrays of every caller joined, and their futures."""

    __slots__ = ("sql", "values", "futures")

    def __init__(self, sql: str) -> None:
        self.sql = sql
        self.values: list[Any] = []
        self.futures: list[asyncio.Future[None]] = []

    def alone(self) -> _Grouped:
        """Itself as a statement of its own (no statement came to ride, or the one it rode failed)."""
        statement = _Grouped(self.sql.format("$1"), (self.values,), row=False)
        statement.future.add_done_callback(self._settle_from)
        return statement

    def _settle_from(self, future: asyncio.Future[Any]) -> None:
        error = None if future.cancelled() else future.exception()
        self.settle(error)

    def settle(self, error: BaseException | None) -> None:
        for future in self.futures:
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(None)


def _riding(statement: _Grouped, rider: _Rider) -> _Grouped | None:
    """``statement`` with the rider's write in front, as a data-modifying CTE (run once and to
    completion, read or not), in the same statement; None when its text cannot carry one."""
    head = statement.sql.lstrip()
    word = head.split(None, 1)[0].upper() if head else ""
    cte = f"_rider AS ({rider.sql.format(f'${len(statement.args) + 1}')})"
    if word == "WITH":
        sql = f"WITH {cte}, {head[4:].lstrip()}"
    elif word in ("SELECT", "INSERT", "UPDATE", "DELETE"):
        sql = f"WITH {cte} {head}"
    else:
        return None
    riding = copy.copy(statement)  # its callers hear the statement's own outcome
    riding.sql, riding.args = sql, (*statement.args, rider.values)
    return riding


async def _one_by_one(conn: asyncpg.Connection, batch: list[_Grouped], *, alone: bool = False) -> None:
    """A batch that failed, again statement by statement: each caller gets its own outcome.

    ``alone``: a batch of one, sent without ``BEGIN``/``COMMIT``. Every grouped statement is
    a transaction on its own (one statement, or one plpgsql function call), so the server's
    implicit transaction commits it as the explicit one would, in one round trip."""
    for statement in batch:
        try:
            if alone:
                value = await statement.run(conn)
            else:
                async with conn.transaction():
                    value = await statement.run(conn)
        except asyncpg.PostgresError as exc:
            statement.settle(None, exc)
            continue
        statement.settle(value, None)


class _Session:
    """The migration runner's view of one connection (``herald.storage.migrations.Session``)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str) -> None:
        await self._conn.execute(sql)

    async def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in await self._conn.fetch(sql)]

    async def record(self, migration: Migration) -> None:
        await self._conn.execute(
            f"INSERT INTO herald_schema_migrations (version, name, checksum, applied_at) VALUES ($1, $2, $3, {NOW_SQL})",
            migration.version, migration.name, migration.checksum)

    async def record_function(self, function: Function) -> None:
        await self._conn.execute(
            f"INSERT INTO herald_schema_functions (name, checksum, applied_at) VALUES ($1, $2, {NOW_SQL})"
            " ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, applied_at = excluded.applied_at",
            function.name, function.checksum)


class PgDatabase:
    """The pool, and the schema brought up to date when it opens (``herald.storage.postgres.schema.SCHEMA``)."""

    def __init__(self, url: str, schema: Schema, *, min_size: int = 1, max_size: int = 10) -> None:
        self.url = url
        self.schema = schema
        # This process's name on the outbox rows it commits (the column's default reads the
        # session setting): its relay publishes those.
        self.origin = secrets.token_hex(8)
        self._min_size = min_size
        self._max_size = max_size
        self._pool: asyncpg.Pool | None = None
        self._ready = asyncio.Event()
        self._opener: asyncio.Task[None] | None = None
        self._batch: list[_Grouped] = []
        self._committers: set[asyncio.Task[None]] = set()  # at most BATCHES_IN_FLIGHT running
        self._riders: dict[str, _Rider] = {}  # ride: waiting for the next batch's first statement

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None or not self._ready.is_set():
            raise StoreUnavailable("the PostgreSQL store is not reachable yet (HERALD_DATABASE_URL)")
        return self._pool

    async def open(self, *, wait: bool = True) -> None:
        """Connect and migrate, retrying while the server is unreachable.

        ``wait=False`` returns at once and keeps trying in the background (the gateway, so
        that ``/readyz`` can answer 503 meanwhile); calls made before then raise
        ``StoreUnavailable``.
        """
        self._opener = asyncio.create_task(self._open_until_done(), name="postgres-open")
        if wait:
            await asyncio.shield(self._opener)

    @property
    def opened(self) -> bool:
        """``open()`` was called (it may still be connecting)."""
        return self._opener is not None

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def _open_until_done(self) -> None:
        delay = 0.2
        while True:
            try:
                pool = await asyncpg.create_pool(
                    self.url, min_size=self._min_size, max_size=self._max_size, command_timeout=30,
                    reset=_keep_session, server_settings={"herald.origin": self.origin},
                )
                assert pool is not None
                try:
                    await self._migrate(pool)
                except BaseException:
                    await pool.close()
                    raise
            except (*CONNECTION_ERRORS, asyncpg.PostgresError) as exc:
                log.error("cannot open the PostgreSQL store (HERALD_DATABASE_URL): %s; retrying in %.1f s",
                          exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self._pool = pool
            self._ready.set()
            log.info("PostgreSQL store open")
            return

    async def _migrate(self, pool: asyncpg.Pool) -> None:
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            await migrate(_Session(conn), self.schema)

    async def fetchval_grouped(self, sql: str, *args: Any, order: str = "") -> Any:
        """``fetchval`` of a statement that is a transaction on its own, committed together
        with the others queued meanwhile (group commit), while at most ``BATCHES_IN_FLIGHT``
        batches are under way.

        A commit waits for its WAL flush while it still holds its row locks (a tenant's
        rate bucket, a capped claim's counter row), and each flush costs the server a
        write and an fsync. Queued statements run one after another on one connection in
        one transaction, and everyone hears back after its commit. If one of them fails, the
        batch is rolled back and each is run again in a transaction of its own, so only
        the failing one fails. A statement queued alone is sent as it is, committed by the
        server as its own implicit transaction: one round trip, not three; so is a batch of
        statements that are each one function call (``SELECT herald_transition($1, ...)``),
        sent as one ``SELECT f(...) AS r0, g(...) AS r1`` (``_Combined``).

        ``order`` is the tenant whose rows the statement locks. A batch holds every lock
        until its commit, so two processes' batches taking two tenants' rows in opposite
        orders would deadlock (each cycle costs ``deadlock_timeout``, 1 s, and a
        rerun: with ten tenants the bench's end-to-end rate fell to a third). So a batch
        runs in ``order`` order (stable: one tenant's statements keep theirs), the same
        in every process.
        """
        return await self._grouped(_Grouped(sql, args, row=False, order=order))

    def ride(self, sql: str, values: Sequence[Any]) -> asyncio.Future[None]:
        """A write with ``values`` as its one array parameter (``{}`` in ``sql``; the relay's
        outbox deletes) that joins the next batch, as a grouped statement would (the batch
        starts at once when none is being committed), but not as a statement of its own: it
        goes in front of the batch's first statement, in that statement's text (a
        data-modifying CTE), so it costs no round trip or send, and a batch it joins is no
        larger (a statement and a delete were a batch of two: ``BEGIN``, two statements,
        ``COMMIT``). Alone only when nothing else is queued. Calls with the same ``sql`` are
        joined. The future is done once it committed."""
        rider = self._riders.get(sql)
        if rider is None:
            rider = self._riders[sql] = _Rider(sql)
        rider.values.extend(values)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        rider.futures.append(future)
        self._start_committer()
        return future

    def _take_riders(self) -> list[_Rider]:
        riders, self._riders = list(self._riders.values()), {}
        return riders

    def _start_committer(self) -> None:
        # A task is done as soon as its loop found nothing queued, before its done callback
        # runs: a set kept by callbacks alone could count it and leave a statement unsent.
        self._committers = {task for task in self._committers if not task.done()}
        if len(self._committers) < BATCHES_IN_FLIGHT:
            self._committers.add(asyncio.create_task(self._commit_batches(), name="postgres-group-commit"))

    async def _grouped(self, statement: _Grouped) -> Any:
        self._batch.append(statement)
        self._start_committer()
        return await statement.future

    async def _commit_batches(self) -> None:
        while self._batch or self._riders:
            batch, self._batch = self._batch[:MAX_GROUP], self._batch[MAX_GROUP:]
            batch.sort(key=_lock_order)
            riders = self._take_riders()
            # Statements that are each one function call go as one statement (a worker's
            # transitions); each rider goes in front of the first statement that can carry it.
            units: list[_Grouped] = [_Combined(batch)] if _combinable(batch) else batch
            sent = list(units)
            carried: list[_Rider] = []
            unridden: list[_Grouped] = []
            for rider in riders:
                for i, statement in enumerate(units):
                    if sent[i] is statement and (riding := _riding(statement, rider)) is not None:
                        sent[i] = riding
                        carried.append(rider)
                        break
                else:
                    unridden.append(rider.alone())
            sent += unridden
            # If the batch fails: the statements as they were, each in its own transaction,
            # and the riders alone.
            again = batch + unridden + [rider.alone() for rider in carried]
            try:
                async with self.pool.acquire() as conn:
                    if len(sent) == 1:
                        # Alone, it commits as its own implicit transaction: one round trip, not
                        # three (BEGIN and COMMIT are a round trip and a send each; the profile of
                        # a PostgreSQL worker found half its CPU in socket writes).
                        if not carried and not isinstance(sent[0], _Combined):  # its outcome is its caller's
                            await _one_by_one(conn, sent, alone=True)
                            continue
                        try:
                            values = [await sent[0].run(conn)]
                        except asyncpg.PostgresError:
                            await _one_by_one(conn, again, alone=True)
                            continue
                    else:
                        try:
                            async with conn.transaction():
                                values = [await statement.run(conn) for statement in sent]
                        except asyncpg.PostgresError:
                            await _one_by_one(conn, again)
                            continue
            except BaseException as exc:  # the pool or the connection failed: every caller hears it
                for statement in sent:
                    statement.settle(None, exc)
                for rider in carried:
                    rider.settle(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for statement, value in zip(sent, values):
                statement.settle(value, None)
            for rider in carried:
                rider.settle(None)

    async def clock(self) -> float:
        return float(await self.pool.fetchval(f"SELECT {NOW_SQL}"))

    async def ping(self) -> None:
        await self.pool.fetchval("SELECT 1")

    async def close(self) -> None:
        if self._committers:
            await asyncio.wait(self._committers)  # the statements already queued still commit
        if self._opener is not None and not self._opener.done():
            self._opener.cancel()
            try:
                await self._opener
            except (asyncio.CancelledError, Exception):
                pass
        if self._pool is not None:
            pool, self._pool = self._pool, None
            self._ready.clear()
            await pool.close()
