"""The migration runner (``herald.storage.migrations``) on both stores, against real databases.

For each backend: a new database gets every version, recorded; opening it again applies
nothing; a database made by the code before the runner (``tests/legacy_schema/``, the
schema as main had it) is adopted -- its versions recorded, none run again -- and ends
with the very schema a new one has; and several processes starting at once on a new
database apply each migration exactly once. PostgreSQL's functions are repeatable
definitions (``sql/functions/``): applied once to a database that lacks their current form,
again when one changes, never when none did.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from herald.storage.migrations import Function, Migration, Schema, load, load_functions, render
from herald.storage.postgres import schema as pg_schema
from herald.storage.postgres.db import PgDatabase
from herald.storage.sqlite import schema as sqlite_schema
from herald.storage.sqlite.db import Database, statements
from tests.harness import new_database

LEGACY = Path(__file__).parent / "legacy_schema"
PG_VERSIONS = [m.version for m in pg_schema.SCHEMA.migrations]
SQLITE_VERSIONS = [m.version for m in sqlite_schema.SCHEMA.migrations]
PG_FUNCTIONS = [f.name for f in pg_schema.SCHEMA.functions]
RUNNER_TABLES = ("herald_schema_migrations", "herald_schema_functions", "herald_migrations", "sqlite_sequence")


# ----- the files ------------------------------------------------------------------------------


def test_each_backend_numbers_its_files_from_one_without_gaps() -> None:
    assert PG_VERSIONS == list(range(1, len(PG_VERSIONS) + 1)) and len(PG_VERSIONS) >= 12
    assert SQLITE_VERSIONS == list(range(1, len(SQLITE_VERSIONS) + 1)) and len(SQLITE_VERSIONS) >= 4
    assert all(not re.search(r"\{[a-z_]+\}", m.sql) for m in pg_schema.SCHEMA.migrations)  # every placeholder filled
    assert all(not re.search(r"\{[a-z_]+\}", f.sql) for f in pg_schema.SCHEMA.functions)


def test_functions_are_defined_once_in_functions_and_never_in_a_numbered_file() -> None:
    assert PG_FUNCTIONS == sorted(PG_FUNCTIONS) and "webhooks_claim" in PG_FUNCTIONS
    assert not [m.name for m in pg_schema.SCHEMA.migrations if re.search(r"CREATE\s+(OR\s+REPLACE\s+)?FUNCTION", m.sql)]
    defined = [name for f in pg_schema.SCHEMA.functions
               for name in re.findall(r"CREATE OR REPLACE FUNCTION (\w+)\(", f.sql)]
    assert len(defined) == len(set(defined)) and "herald_webhook_claim" in defined


def test_a_repeatable_file_with_a_plain_create_function_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "plain"
    (package / "sql" / "functions").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sql" / "functions" / "f.sql").write_text("CREATE FUNCTION f() RETURNS INT LANGUAGE sql AS 'SELECT 1';")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="CREATE OR REPLACE"):
        load_functions("plain")


def test_a_placeholder_the_backend_does_not_define_is_an_error_and_other_braces_stay() -> None:
    assert render("SELECT '{}', {now}", {"now": 1}) == "SELECT '{}', 1"
    with pytest.raises(KeyError, match="nwo"):
        render("SELECT {nwo}", {"now": 1})


def test_a_file_named_out_of_sequence_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "gappy"
    (package / "sql").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sql" / "0001_a.sql").write_text("SELECT 1;")
    (package / "sql" / "0003_c.sql").write_text("SELECT 3;")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        load("gappy")


def test_a_script_splits_into_whole_statements() -> None:
    script = "CREATE TABLE a (x TEXT DEFAULT ';');\n-- a comment; with a semicolon\nINSERT INTO a VALUES ('x;y');\n"
    assert [s.strip() for s in statements(script)] == [
        "CREATE TABLE a (x TEXT DEFAULT ';');", "-- a comment; with a semicolon\nINSERT INTO a VALUES ('x;y');"]


# ----- SQLite -----------------------------------------------------------------------------------


def _sqlite_schema(path: Path) -> dict[str, Any]:
    """What the schema is, told apart from how it was written: columns, indexes, their SQL."""
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
                  if r[0] not in RUNNER_TABLES]
        return {
            "columns": {t: conn.execute(f"PRAGMA table_xinfo({t})").fetchall() for t in tables},
            "without_rowid": {t: "WITHOUT ROWID" in conn.execute(
                "SELECT sql FROM sqlite_master WHERE name = ?", (t,)).fetchone()[0] for t in tables},
            "indexes": conn.execute("SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'index'"
                                    " ORDER BY name").fetchall(),
            "directory": conn.execute("SELECT id, version FROM herald_directory").fetchall(),
        }
    finally:
        conn.close()


def _sqlite_records(path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT version, name, checksum, applied_at FROM herald_schema_migrations"
                            " ORDER BY version").fetchall()


async def _open_sqlite(path: Path) -> None:
    db = Database(path, sqlite_schema.SCHEMA)
    await db.open()
    await db.close()


async def test_sqlite_new_database_gets_every_version_and_a_second_open_applies_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "herald.db"
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_sqlite(path)
    first = _sqlite_records(path)
    assert [(v, n, c) for v, n, c, _ in first] == [(m.version, m.name, m.checksum) for m in sqlite_schema.SCHEMA.migrations]
    assert [r.migration for r in caplog.records if r.getMessage() == "schema migration applied"] == SQLITE_VERSIONS  # type: ignore[attr-defined]
    caplog.clear()
    schema = _sqlite_schema(path)
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_sqlite(path)
    assert _sqlite_records(path) == first  # nothing applied or recorded again
    assert not [r for r in caplog.records if r.name == "herald.migrations"]
    assert _sqlite_schema(path) == schema


def _legacy_sqlite(path: Path, *, drop_later_columns: bool = False) -> None:
    """A data dir as the code before the runner left it, with a job in it."""
    with sqlite3.connect(path) as conn:
        conn.executescript((LEGACY / "sqlite.sql").read_text())
        if drop_later_columns:  # older still: before trace contexts and outbox origins
            for table, column in [("jobs", "traceparent"), ("jobs", "tracestate"), ("jobs", "result_body"),
                                  ("outbox", "traceparent"), ("outbox", "tracestate"), ("outbox", "origin")]:
                conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        conn.execute("INSERT INTO jobs (id, tenant, kind, collection, state, params, version, attempt, created_at,"
                     " updated_at, deadline_at) VALUES ('j1', 't', 'report', 'c', 'queued', x'00', 1, 0, 1, 1, 2)")


@pytest.mark.parametrize("older", [False, True], ids=["as-main-made-it", "before-later-columns"])
async def test_sqlite_database_from_before_the_runner_is_adopted_not_rebuilt(
    tmp_path: Path, older: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    new = tmp_path / "new.db"
    await _open_sqlite(new)
    old = tmp_path / "old.db"
    _legacy_sqlite(old, drop_later_columns=older)

    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_sqlite(old)

    assert [r[:3] for r in _sqlite_records(old)] == [r[:3] for r in _sqlite_records(new)]
    records = [r for r in caplog.records if r.name == "herald.migrations"]
    # What the old script made is recorded, not run again; what came after it (4: the keys
    # PostgreSQL has) runs.
    applied = [r.migration for r in records if r.getMessage() == "schema migration applied"]  # type: ignore[attr-defined]
    assert applied == SQLITE_VERSIONS[3:] and len(records) == len(SQLITE_VERSIONS)
    with sqlite3.connect(old) as conn:
        assert conn.execute("SELECT id, traceparent FROM jobs").fetchall() == [("j1", None)]
    adopted, fresh = _sqlite_schema(old), _sqlite_schema(new)
    assert adopted == fresh


async def test_sqlite_migration_4_keeps_every_delivery_and_the_keys_postgres_has(tmp_path: Path) -> None:
    """Migration 4 makes webhook_deliveries again (UNIQUE (event_id, target), as PostgreSQL):
    every row kept with its seq, and no seq ever used comes again."""
    path = tmp_path / "herald.db"
    before = Database(path, Schema(sqlite_schema.SCHEMA.migrations[:3]))
    await before.open()
    await before.close()

    def indexes() -> set[str]:
        with sqlite3.connect(path) as conn:
            return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'"
                                               " AND tbl_name = 'webhook_deliveries' AND sql IS NOT NULL")}

    made = indexes()
    # the columns migration 4 keeps (later migrations add more)
    kept = ("seq, id, tenant, target, endpoint_id, url, event_id, job_id, version, type, status, attempts,"
            " scheduled_at, next_attempt_at, lease_owner, lease_until, created_at, updated_at")
    insert = ("INSERT INTO webhook_deliveries (id, tenant, target, event_id, job_id, version, type, status,"
              " attempts, scheduled_at, created_at, updated_at) VALUES (?, 't', ?, ?, 'j', ?, 'job.running',"
              " 'pending', 0, 1, 1, 1)")
    with sqlite3.connect(path) as conn:
        for n in range(1, 6):
            conn.execute(insert, (f"d{n}", "ep", f"evt_j.{n}", n))
        conn.execute("DELETE FROM webhook_deliveries WHERE id IN ('d1', 'd5')")  # pruned, say
        rows = conn.execute(f"SELECT {kept} FROM webhook_deliveries ORDER BY seq").fetchall()

    await _open_sqlite(path)

    # Every index an older migration made is made again (one added to webhook_deliveries in a
    # migration before 4 must be added to 4 too, or the rebuild drops it).
    assert indexes() == made
    with sqlite3.connect(path) as conn:
        assert conn.execute(f"SELECT {kept} FROM webhook_deliveries ORDER BY seq").fetchall() == rows
        conn.execute(insert, ("d6", "ep", "evt_j.6", 6))
        assert conn.execute("SELECT seq FROM webhook_deliveries WHERE id = 'd6'").fetchone() == (6,)  # not 5 again
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(insert, ("d7", "ep", "evt_j.6", 6))  # one delivery per event and target
        unique = [conn.execute(f"PRAGMA index_info({name})").fetchall()
                  for _, name, is_unique, *_ in conn.execute("PRAGMA index_list(webhook_deliveries)") if is_unique]
        assert [[column for *_, column in index] for index in unique if len(index) == 2] == [["event_id", "target"]]
        # Pruning asks "does a delivery still need this message?" by event: an index probe.
        plan = conn.execute("EXPLAIN QUERY PLAN SELECT 1 FROM webhook_deliveries d WHERE d.event_id = ?",
                            ("evt_j.2",)).fetchall()
        assert "USING COVERING INDEX" in plan[0][3], plan
        # At most one current key per owner; a job's idempotency keys are found by job.
        key = "INSERT INTO webhook_keys (owner, created_at, algorithm, secret) VALUES ('o', ?, 'hmac-sha256', x'00')"
        conn.execute(key, (1.0,))
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(key, (2.0,))
        assert "idempotency_by_job" in {r[1] for r in conn.execute("PRAGMA index_list(idempotency_keys)")}


async def test_sqlite_migration_6_keeps_every_event_in_a_rowid_table(tmp_path: Path) -> None:
    """Migration 6 makes events again as a rowid table (issue 24: a WITHOUT ROWID table took
    each tenant's event mid-tree): every row kept, the same keys unique, the same reads by
    index."""
    path = tmp_path / "herald.db"
    before = Database(path, Schema(sqlite_schema.SCHEMA.migrations[:5]))
    await before.open()
    await before.close()
    insert = ("INSERT INTO events (tenant, seq, job_id, kind, version, type, at, data)"
              " VALUES (?, ?, ?, 'report', ?, 'job.running', 1.0, x'7b7d')")
    with sqlite3.connect(path) as conn:
        for n in range(1, 5):
            conn.execute(insert, ("t1" if n % 2 else "t2", n, f"j{n}", 1))
        rows = conn.execute("SELECT * FROM events ORDER BY tenant, seq").fetchall()

    await _open_sqlite(path)

    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT * FROM events ORDER BY tenant, seq").fetchall() == rows
        assert "WITHOUT ROWID" not in conn.execute("SELECT sql FROM sqlite_master WHERE name = 'events'").fetchone()[0]
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(insert, ("t1", 1, "j9", 1))  # one event per tenant and seq
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(insert, ("t1", 9, "j1", 1))  # one event per job and version
        for read, index in [("SELECT * FROM events WHERE tenant = 't1' AND seq > 1 ORDER BY seq LIMIT 10", "events_by_seq"),
                            ("SELECT * FROM events WHERE job_id = 'j1' AND version > 0 ORDER BY version", "events_by_job")]:
            plan = " / ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + read))
            assert f"USING INDEX {index}" in plan and "TEMP B-TREE" not in plan, plan


SQLITE_OPENER = textwrap.dedent("""
    import asyncio, logging, sys
    from pathlib import Path
    from herald.storage.sqlite.db import Database
    from herald.storage.sqlite.schema import SCHEMA

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout)
    sys.stdin.readline()  # everyone starts together

    async def main() -> None:
        db = Database(Path(sys.argv[1]), SCHEMA)
        await db.open()
        await db.close()

    asyncio.run(main())
""")

PG_OPENER = textwrap.dedent("""
    import asyncio, logging, sys
    from herald.storage.postgres.db import PgDatabase
    from herald.storage.postgres.schema import SCHEMA

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout)
    sys.stdin.readline()  # everyone starts together

    async def main() -> None:
        db = PgDatabase(sys.argv[1], SCHEMA, max_size=1)
        await db.open()
        await db.close()

    asyncio.run(main())
""")


def _start_together(code: str, target: str, n: int) -> list[str]:
    """``n`` processes that open ``target`` at the same moment; each one's log."""
    procs = [subprocess.Popen([sys.executable, "-c", code, target], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for _ in range(n)]
    for proc in procs:  # each is blocked on stdin until all are running
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.flush()
    logs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        logs.append(out.decode())
    return logs


def _applied_lines(logs: list[str], what: str = "migration") -> int:
    return sum(line == f"herald.migrations schema {what} applied" for log in logs for line in log.splitlines())


def _functions_applied(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.functions for r in caplog.records if r.getMessage() == "schema functions applied"]  # type: ignore[attr-defined]


def test_sqlite_processes_starting_together_migrate_once(tmp_path: Path) -> None:
    path = tmp_path / "herald.db"
    logs = _start_together(SQLITE_OPENER, str(path), 4)
    assert _applied_lines(logs) == len(SQLITE_VERSIONS), logs
    assert [r[0] for r in _sqlite_records(path)] == SQLITE_VERSIONS


async def test_sqlite_migration_is_one_transaction(tmp_path: Path) -> None:
    """A migration that fails leaves nothing of itself or of those before it in the same open."""
    path = tmp_path / "herald.db"
    broken = Schema((Migration(1, "a", "CREATE TABLE a (x);"), Migration(2, "b", "CREATE TABLE b (x); SELEC 1;")))
    db = Database(path, broken)
    with pytest.raises(sqlite3.OperationalError):
        await db.open()
    await db.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == []


# ----- PostgreSQL -------------------------------------------------------------------------------


async def _pg_schema(url: str) -> dict[str, Any]:
    conn = await asyncpg.connect(url)
    try:
        skip = list(RUNNER_TABLES)
        return {
            "columns": [tuple(r) for r in await conn.fetch(
                "SELECT table_name, ordinal_position, column_name, data_type, is_nullable, column_default,"
                " is_identity, identity_generation FROM information_schema.columns"
                " WHERE table_schema = 'public' AND NOT (table_name = ANY($1)) ORDER BY 1, 2", skip)],
            "indexes": [tuple(r) for r in await conn.fetch(
                "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
                " AND NOT (tablename = ANY($1)) ORDER BY 1, 2", skip)],
            "constraints": [tuple(r) for r in await conn.fetch(
                "SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c"
                " JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = 'public'"
                " AND NOT (c.conrelid::regclass::text = ANY($1)) ORDER BY 1, 2", skip)],
            "functions": [tuple(r) for r in await conn.fetch(
                "SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_function_result(p.oid),"
                " p.prosrc, p.proconfig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = 'public' ORDER BY 1, 2")],
            "directory": [tuple(r) for r in await conn.fetch("SELECT id, version FROM herald_directory")],
        }
    finally:
        await conn.close()


async def _pg_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(sql)]
    finally:
        await conn.close()


async def _pg_records(url: str) -> list[tuple[Any, ...]]:
    return await _pg_rows(url, "SELECT version, name, checksum, applied_at FROM herald_schema_migrations ORDER BY version")


async def _pg_function_records(url: str) -> list[tuple[Any, ...]]:
    return await _pg_rows(url, "SELECT name, checksum, applied_at FROM herald_schema_functions ORDER BY name")


async def _open_pg(url: str) -> None:
    db = PgDatabase(url, pg_schema.SCHEMA, max_size=1)
    await db.open()
    await db.close()


def _legacy_sections() -> list[tuple[str, str]]:
    """The legacy fixture's migrations, (name, SQL), in their order."""
    text = (LEGACY / "postgres.sql").read_text()
    body = text[:text.index("\nCREATE TABLE herald_migrations")]
    parts = re.split(r"^-- ===== (\S+)\n", body, flags=re.M)[1:]
    return list(zip(parts[0::2], parts[1::2]))


async def legacy_pg(url: str, *, upto: str | None = None) -> None:
    """A database as the code before the runner left it (every migration up to ``upto``), with a job in it."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE TABLE herald_migrations (name TEXT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)")
        for name, sql in _legacy_sections():
            await conn.execute(sql)
            await conn.execute("INSERT INTO herald_migrations VALUES ($1, 0)", name)
            if name == upto:
                break
        await conn.execute("INSERT INTO jobs (id, tenant, kind, collection, state, params, version, attempt,"
                           " created_at, updated_at, deadline_at) VALUES ('j1', 't', 'report', 'c', 'queued', '\\x00',"
                           " 1, 0, 1, 1, 2)")
    finally:
        await conn.close()


async def test_the_legacy_fixture_is_the_whole_of_the_old_chain() -> None:
    assert [name for name, _ in _legacy_sections()] == list(pg_schema.LEGACY_NAMES)


async def test_postgres_new_database_gets_every_version_and_a_second_open_applies_nothing(
    fresh_database: str, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_pg(fresh_database)
    first = await _pg_records(fresh_database)
    assert [(v, n, c) for v, n, c, _ in first] == [(m.version, m.name, m.checksum) for m in pg_schema.SCHEMA.migrations]
    assert [r.migration for r in caplog.records if r.getMessage() == "schema migration applied"] == PG_VERSIONS  # type: ignore[attr-defined]
    assert _functions_applied(caplog) == PG_FUNCTIONS
    functions = await _pg_function_records(fresh_database)
    assert [(n, c) for n, c, _ in functions] == [(f.name, f.checksum) for f in pg_schema.SCHEMA.functions]
    schema = await _pg_schema(fresh_database)
    assert not [f for f in schema["functions"] if f[0] == "herald_webhook_claim" and "p_held" not in f[1]]
    # dead functions are gone: the old claims, the key functions the rulebook replaced
    assert not {f[0] for f in schema["functions"]} & {"herald_webhook_add_key", "herald_webhook_ensure_key"}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_pg(fresh_database)
    assert await _pg_records(fresh_database) == first
    assert await _pg_function_records(fresh_database) == functions
    assert not [r for r in caplog.records if r.name == "herald.migrations"]
    assert await _pg_schema(fresh_database) == schema


async def test_postgres_database_from_before_the_runner_is_adopted_not_rebuilt(
    postgres_server: Any, fresh_database: str, caplog: pytest.LogCaptureFixture,
) -> None:
    old = new_database(postgres_server)
    await legacy_pg(old)
    conn = await asyncpg.connect(old)
    try:
        claim_oid = await conn.fetchval("SELECT 'herald_webhook_claim'::regproc::oid")
    finally:
        await conn.close()

    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_pg(old)

    records = [r for r in caplog.records if r.name == "herald.migrations"]
    adopted = sorted(pg_schema.LEGACY_NAMES.values())
    assert [r.migration for r in records if r.getMessage().startswith("schema migration recorded")] == adopted  # type: ignore[attr-defined]
    # applied: only what came after the runner (never one of the old chain)
    assert [r.migration for r in records if r.getMessage() == "schema migration applied"] == [  # type: ignore[attr-defined]
        v for v in PG_VERSIONS if v not in adopted]
    # the functions: each file once (CREATE OR REPLACE: the same functions, in their current form)
    assert _functions_applied(caplog) == PG_FUNCTIONS
    await _open_pg(fresh_database)
    assert [r[:3] for r in await _pg_records(old)] == [r[:3] for r in await _pg_records(fresh_database)]
    conn = await asyncpg.connect(old)
    try:  # no table was made again, no function dropped: the claim is the very function it was, the job is there
        assert await conn.fetchval("SELECT 'herald_webhook_claim'::regproc::oid") == claim_oid
        assert await conn.fetchval("SELECT id FROM jobs") == "j1"
    finally:
        await conn.close()
    assert await _pg_schema(old) == await _pg_schema(fresh_database)


@pytest.mark.parametrize("upto", list(pg_schema.LEGACY_NAMES)[:-1])
async def test_postgres_database_part_way_through_the_old_chain_gets_the_rest(
    postgres_server: Any, fresh_database: str, caplog: pytest.LogCaptureFixture, upto: str,
) -> None:
    """Stopped after any step of the old chain: the rest is applied, and every function ends
    in its current form, whatever form the step left it in (a signature or result type that
    changed since is dropped by a numbered file: before the fair claim, the claim of six
    parameters goes)."""
    old = new_database(postgres_server)
    await legacy_pg(old, upto=upto)
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_pg(old)
    applied = [r.migration for r in caplog.records if r.getMessage() == "schema migration applied"]  # type: ignore[attr-defined]
    names = [name for name, _ in _legacy_sections()]
    had = {pg_schema.LEGACY_NAMES[name] for name in names[:names.index(upto) + 1]}
    assert applied == [v for v in PG_VERSIONS if v not in had]
    assert _functions_applied(caplog) == PG_FUNCTIONS
    await _open_pg(fresh_database)
    assert await _pg_schema(old) == await _pg_schema(fresh_database)


async def test_postgres_processes_starting_together_migrate_once(fresh_database: str) -> None:
    logs = await asyncio.to_thread(_start_together, PG_OPENER, fresh_database, 4)
    assert _applied_lines(logs) == len(PG_VERSIONS), logs
    assert _applied_lines(logs, "functions") == len(PG_FUNCTIONS), logs
    assert not [line for log in logs for line in log.splitlines() if "cannot open" in line], logs
    assert [r[0] for r in await _pg_records(fresh_database)] == PG_VERSIONS
    assert [r[0] for r in await _pg_function_records(fresh_database)] == PG_FUNCTIONS


async def test_postgres_database_from_before_the_functions_moved_gets_them_once_and_no_warning(
    fresh_database: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A database the runner made while the numbered files still defined the functions: its
    records name those files' checksums then (EARLIER_CHECKSUMS) and it has no function record."""
    await _open_pg(fresh_database)
    schema = await _pg_schema(fresh_database)
    conn = await asyncpg.connect(fresh_database)
    try:
        for version, (checksum,) in pg_schema.EARLIER_CHECKSUMS.items():
            await conn.execute("UPDATE herald_schema_migrations SET checksum = $1 WHERE version = $2", checksum, version)
        await conn.execute("DROP TABLE herald_schema_functions")
    finally:
        await conn.close()
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_pg(fresh_database)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.getMessage() == "schema migration applied"]
    assert _functions_applied(caplog) == PG_FUNCTIONS
    assert await _pg_schema(fresh_database) == schema


_F = "CREATE OR REPLACE FUNCTION {name}() RETURNS INTEGER LANGUAGE plpgsql AS $$ BEGIN RETURN {value}; END $$;"


def _toy_schema(f_value: int, *, with_g: bool = True) -> Schema:
    functions = [Function("f", _F.format(name="herald_toy_f", value=f_value))]
    if with_g:
        functions.append(Function("g", _F.format(name="herald_toy_g", value=7)))
    return Schema((Migration(1, "t", "CREATE TABLE toy (x INTEGER);"),), functions=tuple(functions))


async def _open_toy(url: str, schema: Schema) -> None:
    db = PgDatabase(url, schema, max_size=1)
    await db.open()
    await db.close()


async def test_postgres_a_changed_function_is_applied_once_and_an_unchanged_one_not(
    fresh_database: str, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_toy(fresh_database, _toy_schema(1))
    assert _functions_applied(caplog) == ["f", "g"]
    before = dict((n, (c, at)) for n, c, at in await _pg_function_records(fresh_database))

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_toy(fresh_database, _toy_schema(2))  # f changed, g not
    assert _functions_applied(caplog) == ["f"]
    assert not [r for r in caplog.records if r.getMessage() == "schema migration applied"]
    after = dict((n, (c, at)) for n, c, at in await _pg_function_records(fresh_database))
    assert after["g"] == before["g"] and after["f"][0] == _toy_schema(2).functions[0].checksum != before["f"][0]
    conn = await asyncpg.connect(fresh_database)
    try:
        assert (await conn.fetchval("SELECT herald_toy_f()"), await conn.fetchval("SELECT herald_toy_g()")) == (2, 7)
    finally:
        await conn.close()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_toy(fresh_database, _toy_schema(2))
    assert not [r for r in caplog.records if r.name == "herald.migrations"]

    # a file that goes is forgotten (its function is dropped by a numbered migration), so
    # the same file added back is applied again
    conn = await asyncpg.connect(fresh_database)
    try:
        await conn.execute("DROP FUNCTION herald_toy_g()")
    finally:
        await conn.close()
    await _open_toy(fresh_database, _toy_schema(2, with_g=False))
    assert [r[0] for r in await _pg_function_records(fresh_database)] == ["f"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="herald.migrations"):
        await _open_toy(fresh_database, _toy_schema(2))
    assert _functions_applied(caplog) == ["g"]


async def test_postgres_a_function_that_fails_leaves_the_whole_migration_undone(fresh_database: str) -> None:
    broken = Schema((Migration(1, "t", "CREATE TABLE toy (x INTEGER);"),),
                    functions=(Function("f", "CREATE OR REPLACE FUNCTION herald_toy_f() RETURNS INTEGER LANGUAGE sql AS"
                                             " 'SELECT x FROM no_such_table';"),))
    db = PgDatabase(fresh_database, broken, max_size=1)
    pool = await asyncpg.create_pool(fresh_database, min_size=1, max_size=1)
    assert pool is not None
    try:
        with pytest.raises(asyncpg.PostgresError):
            await db._migrate(pool)  # open() would retry it for ever
        assert await pool.fetchval("SELECT to_regclass('toy') IS NULL AND to_regclass('herald_schema_migrations') IS NULL")
    finally:
        await pool.close()

