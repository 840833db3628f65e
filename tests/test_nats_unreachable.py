"""NATS that is not there, refuses Herald's credentials, or has no JetStream (SPEC §1, §9).

A first connection that no server accepts ends (``NatsConnectError``, naming
HERALD_NATS_URL and why: unreachable, or authorization refused) instead of being retried
inside nats-py for ever; the components retry it themselves until NATS is there, and stop at
once on SIGTERM whatever the attempt under way was doing. Once connected, reconnects never
stop (NATS restarts must not kill a component: test_faults.py). A server that answers
without JetStream is no state that passes: every process, and herald up, stops at once
saying so (``JetStreamNotEnabled``), exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from herald import jetstream
from herald.settings import Settings
from launcher import supervisor
from launcher.supervisor import find_nats_server
from tests.harness import Deployment, NatsServer, free_port, wait_until

# Well under the 20 s after which a stopping component gives up and exits 3
# (launcher/cli.py, HERALD_WORKER_GRACE_S + STOP_DEADLINE_S), with room for a loaded machine.
STOP_S = 8.0
PASSWORD = "right-password"


@contextlib.contextmanager
def nats_server(*args: str) -> Iterator[int]:
    """A nats-server of the test's own with ``args``; yields its port."""
    binary = find_nats_server()
    assert binary
    port = free_port()
    process = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        assert process.poll() is None, f"nats-server exited with {process.returncode}"
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(listening, timeout=10, what=f"nats-server {' '.join(args)} listening")
        yield port
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def password_nats() -> Iterator[int]:
    """A nats-server that takes only user ``herald`` with PASSWORD; yields its port."""
    with nats_server("--user", "herald", "--pass", PASSWORD) as port:
        yield port


@pytest.fixture
def plain_nats() -> Iterator[int]:
    """A nats-server without JetStream (no -js); yields its port."""
    with nats_server() as port:
        yield port


# ----- the first connection ends, and says why -------------------------------------------------


async def test_a_first_connect_to_a_port_nobody_listens_on_fails_naming_herald_nats_url(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(jetstream.NatsConnectError) as raised:
        # nats-py with max_reconnect_attempts=-1 never returned from here
        await asyncio.wait_for(jetstream.connect(Settings(data_dir=tmp_path, nats_url=url), "test"), timeout=15)
    assert time.monotonic() - started < 10
    assert not raised.value.authorization
    assert f"NATS at {url} (HERALD_NATS_URL) is not reachable" in str(raised.value)


async def test_a_wrong_password_fails_the_first_connect_as_authorization_refused(
        tmp_path: Path, password_nats: int) -> None:
    url = f"nats://herald:wrong-password@127.0.0.1:{password_nats}"
    with pytest.raises(jetstream.NatsConnectError) as raised:
        await asyncio.wait_for(jetstream.connect(Settings(data_dir=tmp_path, nats_url=url), "test"), timeout=15)
    assert raised.value.authorization
    message = str(raised.value)
    assert "refused authorization" in message and "HERALD_NATS_URL" in message
    assert "wrong-password" not in message  # the URL is named without its password
    # The right one connects, through the same call.
    right = f"nats://herald:{PASSWORD}@127.0.0.1:{password_nats}"
    nc = await asyncio.wait_for(jetstream.connect(Settings(data_dir=tmp_path, nats_url=right), "test"), timeout=15)
    await nc.close()


async def test_once_connected_reconnects_never_give_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first connect's bound is for the first connect only: a NATS that is away for many
    failed reconnects is still found again when it comes back."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        nc = await jetstream.connect(Settings(data_dir=tmp_path, nats_url=server.url), "test")
        try:
            assert nc.options["max_reconnect_attempts"] == -1
            caplog.set_level(logging.WARNING, logger="herald.nats")
            server.stop()
            more_than_the_first_connects = 3 * (jetstream.FIRST_CONNECT_RETRIES + 1)

            def failed_reconnects() -> int:
                return sum("nats error" in r.getMessage() for r in caplog.records)

            deadline = time.monotonic() + 30
            while failed_reconnects() < more_than_the_first_connects:
                assert time.monotonic() < deadline, "nats-py did not try to reconnect"
                await asyncio.sleep(0.05)
            assert not nc.is_closed
            server.start()
            deadline = time.monotonic() + 30
            while not nc.is_connected:
                assert not nc.is_closed and time.monotonic() < deadline, "the client gave up reconnecting"
                await asyncio.sleep(0.05)
            await asyncio.wait_for(nc.flush(), timeout=10)
        finally:
            await nc.close()
    finally:
        server.stop()


# ----- a stop ends the wait at once ------------------------------------------------------------


async def test_connect_until_ready_returns_none_as_soon_as_stop_is_set(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="herald.nats")
    stop = asyncio.Event()
    settings = Settings(data_dir=tmp_path, nats_url=f"nats://127.0.0.1:{free_port()}")
    waiting = asyncio.create_task(jetstream.connect_until_ready(settings, "test", stop=stop))
    try:
        deadline = time.monotonic() + 15
        while not any(r.name == "herald.nats" for r in caplog.records):
            assert time.monotonic() < deadline and not waiting.done(), "no word of the unreachable NATS"
            await asyncio.sleep(0.02)
        stop.set()
        assert await asyncio.wait_for(asyncio.shield(waiting), timeout=2) is None
        assert any("HERALD_NATS_URL" in r.getMessage() and "not reachable" in r.getMessage() for r in caplog.records)
    finally:
        if not waiting.done():
            waiting.cancel()
            await asyncio.wait({waiting}, timeout=20)


async def test_until_stopped_ends_work_that_swallows_a_cancellation() -> None:
    """What nats-py's connect does when a cancellation meets Python 3.11's ``asyncio.wait_for``
    just as the socket's connect fails: the cancellation is lost and it tries the next server.
    A stop must end it anyway."""
    cancels: list[float] = []

    async def obstinate() -> str:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels.append(time.monotonic())
                if len(cancels) == 1:
                    continue  # lost, as in the race
                raise

    stop = asyncio.Event()
    work = asyncio.create_task(jetstream.until_stopped(obstinate(), stop))
    await asyncio.sleep(0)
    stop.set()
    with pytest.raises(jetstream.Stopped):
        await asyncio.wait_for(work, timeout=3)
    assert len(cancels) == 2


# ----- the processes: SIGTERM stops them promptly, exit 0, NATS never reached --------------------


@pytest.mark.parametrize("command", ["worker", "notifier", "gateway"])
def test_sigterm_stops_a_component_that_never_reached_nats(tmp_path: Path, command: str) -> None:
    deployment = Deployment(tmp_path)  # its nats-server is never started: nothing listens on its port
    try:
        process = deployment._spawn(command, [command], deployment.env(HERALD_HTTP_PORT=str(free_port())))

        def tried_nats() -> bool:
            assert process.poll() is None, deployment.log_text(command)[-3000:]
            return any(e.get("logger") == "herald.nats" for e in deployment.log_events(command))

        wait_until(tried_nats, timeout=60, what=f"{command} trying to reach NATS")
        process.send_signal(signal.SIGTERM)
        code = _exit_code(process, STOP_S, f"{command}, sent SIGTERM,", lambda: deployment.log_text(command))
        log = deployment.log_text(command)
        assert code == 0, log[-3000:]
        assert "shutdown took longer" not in log
        complaints = [str(e.get("event")) for e in deployment.log_events(command) if e.get("logger") == "herald.nats"]
        assert any("HERALD_NATS_URL" in c and "is not reachable" in c for c in complaints), complaints
    finally:
        deployment.stop()


def test_a_component_started_before_its_nats_waits_for_it_and_runs(tmp_path: Path) -> None:
    """A NATS still starting is retried, never taken for one without JetStream."""
    deployment = Deployment(tmp_path)  # its nats-server starts only once the worker has tried it
    try:
        process = deployment._spawn("worker", ["worker"], deployment.env())

        def tried_nats() -> bool:
            assert process.poll() is None, deployment.log_text("worker")[-3000:]
            return any("is not reachable" in str(e.get("event")) for e in deployment.log_events("worker"))

        wait_until(tried_nats, timeout=60, what="the worker trying to reach NATS")
        deployment.nats.start()
        deployment._wait_ready("worker", lambda: deployment.logged("worker", "worker ready"))
        assert not any("JetStream is not enabled" in str(e.get("event")) for e in deployment.log_events("worker"))
    finally:
        deployment.stop()


# ----- a NATS without JetStream: no waiting, one line, exit 2 ---------------------------------------

# A process (or herald up) ends within this; it retried a minute first (jetstream.TOPOLOGY_RETRY_FOR_S),
# and its own start takes seconds on a loaded machine.
FAILS_WITHIN_S = 20.0
NOT_ENABLED = "JetStream is not enabled on the NATS server at"


async def test_ensure_topology_fails_at_once_on_a_server_without_jetstream(tmp_path: Path, plain_nats: int) -> None:
    url = f"nats://127.0.0.1:{plain_nats}"
    settings = Settings(data_dir=tmp_path, nats_url=url)
    nc = await jetstream.connect(settings, "test")  # it answers: no NatsConnectError
    try:
        with pytest.raises(jetstream.JetStreamNotEnabled) as raised:
            await asyncio.wait_for(jetstream.ensure_topology(nc.jetstream(), settings), timeout=10)
    finally:
        await nc.close()
    assert not raised.value.for_account
    assert str(raised.value).startswith(f"{NOT_ENABLED} {url} (HERALD_NATS_URL): start nats-server with -js")


async def test_an_account_without_jetstream_is_told_from_one_with_it(tmp_path: Path) -> None:
    """JetStream on the server, but not for the account of Herald's user: the server says so
    (err_code 10039), and that is no waiting matter either. The account with it is served."""
    conf = tmp_path / "accounts.conf"
    conf.write_text(f"jetstream {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\n"
                    "accounts {\n"
                    "  WITH { jetstream: enabled, users: [{user: with, password: pw}] }\n"
                    "  WITHOUT { users: [{user: without, password: pw}] }\n"
                    "}\n")
    with nats_server("-c", str(conf)) as port:
        without = Settings(data_dir=tmp_path, nats_url=f"nats://without:pw@127.0.0.1:{port}")
        nc = await jetstream.connect(without, "test")
        try:
            with pytest.raises(jetstream.JetStreamNotEnabled) as raised:
                await asyncio.wait_for(jetstream.ensure_topology(nc.jetstream(), without), timeout=10)
        finally:
            await nc.close()
        assert raised.value.for_account
        assert f"not enabled for Herald's account on the NATS server at nats://without:***@127.0.0.1:{port}" in str(
            raised.value)
        with_it = Settings(data_dir=tmp_path, nats_url=f"nats://with:pw@127.0.0.1:{port}")
        nc = await jetstream.connect(with_it, "test")
        try:
            await asyncio.wait_for(jetstream.ensure_topology(nc.jetstream(), with_it), timeout=30)
        finally:
            await nc.close()


@pytest.mark.parametrize("command", ["worker", "notifier", "gateway"])
def test_a_component_stops_at_once_on_a_nats_without_jetstream(tmp_path: Path, plain_nats: int, command: str) -> None:
    url = f"nats://127.0.0.1:{plain_nats}"
    deployment = Deployment(tmp_path)  # its own nats-server is never started
    try:
        process = deployment._spawn(command, [command], deployment.env(HERALD_NATS_URL=url,
                                                                        HERALD_HTTP_PORT=str(free_port())))
        code = _exit_code(process, FAILS_WITHIN_S, f"{command} on a NATS without JetStream",
                          lambda: deployment.log_text(command))
        events = deployment.log_events(command)
        assert code == 2, deployment.log_text(command)[-3000:]
        said = [e for e in events if "JetStream is not enabled" in str(e.get("event"))]
        assert len(said) == 1, said
        assert said[0]["level"] == "error" and said[0]["event"].startswith(f"{NOT_ENABLED} {url} (HERALD_NATS_URL)")
        assert not [e for e in events if "raw" in e], "one line, no traceback"
    finally:
        deployment.stop()


# ----- herald up with an external NATS that is not there, or refuses it ----------------------------

# herald up gives up on NATS after supervisor.NATS_WAIT_S (10 s); its own start (imports) takes
# seconds on a loaded machine.
UP_GIVES_UP_S = 40.0


@contextlib.contextmanager
def herald_up(tmp_path: Path, nats_url: str, *args: str, **extra: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``herald up *args`` with HERALD_NATS_URL, in a session of its own (as a terminal runs
    it); its process group is killed at the end if it is still there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_NATS_URL=nats_url, HERALD_HTTP_PORT=str(free_port()), HERALD_DATA_DIR=str(tmp_path / "var"),
               HERALD_LOG_LEVEL="warning", **extra)
    output = tmp_path / "up.log"
    with open(output, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", *args], env=env, stdout=log,
                                   stderr=log, start_new_session=True)
    try:
        yield process, output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _ended(process: subprocess.Popen[bytes], output: Path, within: float) -> int:
    return _exit_code(process, within, "herald up", lambda: output.read_text(errors="replace"))


def _exit_code(process: subprocess.Popen[bytes], within: float, what: str, said: Callable[[], str]) -> int:
    """The process's exit code once it ended, at most ``within`` s from now; else what it said."""
    try:
        return process.wait(within)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what} still running after {within:g} s; it said:\n{said()[-3000:]}") from None


def test_herald_up_gives_up_on_an_unreachable_nats_url_and_says_so(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    with herald_up(tmp_path, url) as (process, output):
        code = _ended(process, output, UP_GIVES_UP_S)
        said = output.read_text(errors="replace")
        assert code == 2, said
        assert f"herald: NATS at {url} (HERALD_NATS_URL) is not reachable" in said
        assert f"gave up after {supervisor.NATS_WAIT_S:g} s" in said
        assert "Herald is up" not in said


def test_herald_up_with_a_wrong_nats_password_exits_at_once_saying_authorization(
        tmp_path: Path, password_nats: int) -> None:
    url = f"nats://herald:wrong-password@127.0.0.1:{password_nats}"
    with herald_up(tmp_path, url) as (process, output):
        code = _ended(process, output, UP_GIVES_UP_S)
        said = output.read_text(errors="replace")
        assert code == 2, said
        assert (f"herald: NATS at nats://herald:***@127.0.0.1:{password_nats} (HERALD_NATS_URL) refused authorization"
                in said)
        assert "wrong-password" not in said
        assert "gave up after" not in said  # not waited out: a wrong password does not come right


# herald up --cluster with an external NATS and PostgreSQL starts neither (PostgreSQL is not
# reached before NATS is): nothing listens on either port.
def _cluster(*args: str) -> tuple[tuple[str, ...], dict[str, str]]:
    return ("--cluster", *args), {"HERALD_DATABASE_URL": f"postgresql://herald:pw@127.0.0.1:{free_port()}/herald",
                                  "HERALD_SECRET_KEY": "tests-secret-key-of-at-least-32-characters"}


@pytest.mark.parametrize("cluster", [False, True], ids=["up", "up-cluster"])
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_herald_up_stops_cleanly_while_it_waits_for_nats(tmp_path: Path, how: str, cluster: bool) -> None:
    """Ctrl-C (SIGINT to the process group) or SIGTERM to its pid alone, while ``herald up``
    (or ``herald up --cluster``) is still trying to reach NATS: a prompt clean stop, exit 0
    (SPEC §1, §11)."""
    args, extra = _cluster() if cluster else ((), {})
    with herald_up(tmp_path, f"nats://127.0.0.1:{free_port()}", *args, **extra) as (process, output):
        def trying() -> bool:
            assert process.poll() is None, output.read_text(errors="replace")
            return "nats" in output.read_text(errors="replace").lower()

        wait_until(trying, timeout=60, what="herald up trying to reach NATS")
        if how == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGTERM)
        code = _ended(process, output, STOP_S)
        assert code == 0, output.read_text(errors="replace")


def test_herald_up_cluster_with_a_wrong_nats_password_exits_at_once_saying_authorization(
        tmp_path: Path, password_nats: int) -> None:
    args, extra = _cluster()
    with herald_up(tmp_path, f"nats://herald:wrong-password@127.0.0.1:{password_nats}", *args, **extra) as (
            process, output):
        code = _ended(process, output, UP_GIVES_UP_S)
        said = output.read_text(errors="replace")
        assert code == 2, said
        assert f"nats://herald:***@127.0.0.1:{password_nats} (HERALD_NATS_URL) refused authorization" in said
        assert "wrong-password" not in said


@pytest.mark.parametrize("cluster", [False, True], ids=["up", "up-cluster"])
def test_herald_up_with_a_nats_without_jetstream_exits_at_once_saying_so(
        tmp_path: Path, plain_nats: int, cluster: bool) -> None:
    args, extra = _cluster() if cluster else ((), {})
    url = f"nats://127.0.0.1:{plain_nats}"
    with herald_up(tmp_path, url, *args, **extra) as (process, output):
        code = _ended(process, output, FAILS_WITHIN_S)
        said = output.read_text(errors="replace")
        assert code == 2, said
        assert f"herald: {NOT_ENABLED} {url} (HERALD_NATS_URL)" in said
        assert "gave up after" not in said and "Herald is up" not in said
