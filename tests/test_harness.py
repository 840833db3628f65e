"""The harness itself: a server whose free port is taken before it binds gets another."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests import harness
from tests.harness import Deployment


def test_a_gateway_whose_port_was_taken_before_it_bound_starts_on_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = Deployment(tmp_path)
    deployment.nats.start()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", harness.free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        # The gateway's first choice is the squatter's port, as if it had been taken after
        # free_port chose it; the next choice is a free one.
        ports = iter([taken])
        real_free_port = harness.free_port
        monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or real_free_port())
        try:
            base = deployment.start_gateway()
            assert deployment.ports["gateway"] != taken
            assert httpx.get(base + "/readyz").status_code == 200
            assert "address already in use" in deployment.log_text("gateway")
        finally:
            deployment.stop()


def test_free_ports_are_below_the_kernels_ephemeral_range() -> None:
    # Outgoing connections take their local ports from that range; a server's port must not be one.
    assert harness.free_port() < harness._ephemeral_floor()
