from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Deployment


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
