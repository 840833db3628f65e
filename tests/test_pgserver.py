"""launcher.pgserver: the PostgreSQL server that `herald up --cluster` and the tests start."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import asyncpg
import psutil
import pytest

from launcher.pgserver import PostgresError, PostgresServer, find_postgres_bin
from tests.harness import free_port


def postgres_processes(data_dir: Path) -> list[psutil.Process]:
    """Every live postgres process whose command line names ``data_dir`` (the postmaster)
    or whose parent is such a process (its backends and auxiliary processes)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "ppid"]):
        try:
            if proc.info["name"] == "postgres" and proc.status() != psutil.STATUS_ZOMBIE:
                if str(data_dir) in " ".join(proc.info["cmdline"] or []):
                    found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def query(url: str, sql: str) -> object:
    async def run() -> object:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            return await conn.fetchval(sql)
        finally:
            await conn.close()

    return asyncio.run(run())


def execute(url: str, *statements: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


def test_binaries_are_found() -> None:
    bin_dir = find_postgres_bin()
    assert bin_dir is not None and (bin_dir / "postgres").exists() and (bin_dir / "initdb").exists()


def test_session_server_accepts_connections(postgres_server: PostgresServer, fresh_database: str) -> None:
    assert fresh_database.startswith(f"postgresql://postgres@127.0.0.1:{postgres_server.port}/test_")
    assert query(fresh_database, "SELECT current_database()") == fresh_database.rsplit("/", 1)[1]
    assert query(postgres_server.url("postgres"), "SHOW fsync") == "on"
    assert query(postgres_server.url("postgres"), "SHOW max_connections") == "200"
    assert query(postgres_server.url("postgres"), "SHOW server_encoding") == "UTF8"


def test_create_database_is_idempotent(postgres_server: PostgresServer) -> None:
    first = postgres_server.create_database("idempotent_db")
    again = postgres_server.create_database("idempotent_db")
    assert first == again == postgres_server.url("idempotent_db")
    assert query(first, "SELECT 1") == 1


def test_stop_leaves_no_process_and_restart_keeps_data(server_dir: Path) -> None:
    tmp_path = server_dir
    data_dir = tmp_path / "pg"
    server = PostgresServer(data_dir, port=free_port())
    server.start()
    try:
        url = server.create_database("herald")
        execute(url, "CREATE TABLE kept (v text)", "INSERT INTO kept VALUES ('still here')")
        assert postgres_processes(data_dir), "the postmaster runs with the data dir on its command line"
    finally:
        server.stop()
    assert not server.running
    assert postgres_processes(data_dir) == []

    server.start()  # same data dir, same port: no initdb, the table survives
    try:
        assert query(server.url("herald"), "SELECT v FROM kept") == "still here"
    finally:
        server.stop()
    assert postgres_processes(data_dir) == []


def test_kill_then_start_recovers(server_dir: Path) -> None:
    tmp_path = server_dir
    """A postmaster killed with -9 leaves its backends to notice and exit; start() runs recovery."""
    data_dir = tmp_path / "pg"
    server = PostgresServer(data_dir, port=free_port())
    server.start()
    try:
        url = server.create_database("herald")
        execute(url, "CREATE TABLE t (v int)", "INSERT INTO t VALUES (7)")
        server.kill(signal.SIGKILL)
        server.start()
        assert query(url, "SELECT v FROM t") == 7
    finally:
        server.stop()


def test_long_data_dir_uses_a_short_socket_dir(server_dir: Path) -> None:
    tmp_path = server_dir
    data_dir = tmp_path / ("d" * 60) / ("e" * 40) / "pg"
    with PostgresServer(data_dir, port=free_port()) as server:
        assert query(server.url("postgres"), "SELECT 1") == 1
    assert postgres_processes(data_dir) == []


def test_failure_to_start_says_why(server_dir: Path) -> None:
    tmp_path = server_dir
    with PostgresServer(tmp_path / "a", port=free_port()) as first:
        clash = PostgresServer(tmp_path / "b", port=first.port)  # the port is taken
        with pytest.raises(PostgresError, match="last lines of"):
            clash.start(timeout=20)
        assert not clash.running


def test_the_server_is_handed_none_of_heralds_settings(server_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL never reads HERALD_*, and those carry the operator's secrets; as root it runs
    as another user, who may read its environment (/proc/<pid>/environ)."""
    monkeypatch.setenv("HERALD_SECRET_KEY", "s" * 40)
    monkeypatch.setenv("HERALD_ADMIN_KEY", "a" * 40)
    data_dir = server_dir / "pg"
    with PostgresServer(data_dir, port=free_port(), password="p" * 32) as server:
        assert server.process is not None
        environ = psutil.Process(server.process.pid).environ()
        assert environ.get("LC_ALL") == "C"  # the server's own environment, read
        assert not [k for k in environ if k.startswith("HERALD_")], sorted(environ)
