"""The harness itself: a server whose free port is taken before it binds gets another; a
forked Herald process behaves as one ``python -m launcher.cli`` started."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from tests import forkserver, harness
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


def test_a_forked_process_runs_the_command_and_reports_its_exit_as_popen_does(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path)
    deployment.nats.start()
    try:
        listed = deployment._spawn("kinds", ["kinds"], deployment.env())
        assert isinstance(listed, forkserver.ForkedProcess)
        assert listed.wait(60) == 0
        assert "report" in deployment.log_text("kinds") and "export" in deployment.log_text("kinds")

        # Settings are read in main, from the environment the process was given.
        refused = deployment._spawn("refused", ["worker"], deployment.env(HERALD_WORKER_CONCURRENCY="x"))
        assert refused.wait(60) == 2
        assert "HERALD_WORKER_CONCURRENCY" in deployment.log_text("refused")

        worker = deployment.start_worker()
        assert worker.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(0.1)
        deployment.kill("worker", signal.SIGKILL)
        assert worker.returncode == -signal.SIGKILL

        # SIGTERM stops it cleanly, its log flushed to the end.
        notifier = deployment.start_notifier()
        notifier.send_signal(signal.SIGTERM)
        assert notifier.wait(30) == 0
        assert deployment.logged("notifier", "background task stopped")
    finally:
        deployment.stop()


def test_an_environment_read_at_import_gets_a_process_of_its_own(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path)
    deployment.nats.start()
    try:
        # OTEL_* (or anything but HERALD_*) may be read while modules import, which the fork
        # server did before it knew this environment: such a process is started, not forked.
        started = deployment._spawn("kinds", ["kinds"], deployment.env(OTEL_SERVICE_NAME="elsewhere"))
        assert isinstance(started, subprocess.Popen)
        assert started.wait(60) == 0
    finally:
        deployment.stop()
