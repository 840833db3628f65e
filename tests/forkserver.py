"""Herald's processes for the tests, forked from a process that has imported Herald once.

A gateway took 1.0 s of CPU to come ready and a worker 0.75 s, most of it importing
(Litestar, nats-py and the aiohttp it pulls in, structlog and rich, fpdf2), and the suite
starts about 400 of them on two cores. Forked from a server that imported those modules
already, a gateway comes ready on 0.25-0.3 s of CPU and a worker on 0.05 s: the suite's CPU
went from 1 048 to 860 s, its time from 578-602 to 482 s.

What a forked process runs is what ``python -m launcher.cli <command>`` runs: the same
``launcher.cli.main`` with the same arguments and environment, in a process of its own that
signals, ``kill -9`` and exit codes reach as before; after ``main`` returns, the interpreter
shuts down as usual (threads joined, ``atexit`` handlers, buffers flushed). Only the imports
happened earlier, in the server, and the environment must not differ from the server's in
anything read at import: ``ForkServer.spawn`` forks only when the process's environment is
the server's but for ``HERALD_*`` (which only ``herald.settings`` reads, in ``main``), and
starts ``python -m launcher.cli`` otherwise.

The server is this module run as a program; it talks newline-delimited JSON over a socket
pair. Requests: ``{"argv", "env", "log"}``; answers: ``{"started": pid}`` in request order,
and ``{"exited": pid, "code": returncode}`` (negative: the signal) when it reaps a process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# What a gateway, a worker and a notifier import; what else they need they import themselves.
PRELOAD = (
    "launcher.cli", "launcher.metrics_server", "launcher.gateway_server", "gateway.app", "gateway.headers",
    "workers.runner", "notifier.service", "herald.storage.sqlite", "herald.storage.postgres", "herald.tracing",
    "workers.kinds.report", "workers.kinds.export", "uvicorn", "uvicorn.protocols.http.httptools_impl",
    "uvicorn.lifespan.on", "uvicorn.loops.uvloop",
)
REAP_EVERY_S = 0.02


def _forkable(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` must be the server's for a fork to start what ``python -m`` would:
    all but Herald's settings and pytest's name of the running test (set per test)."""
    return {k: v for k, v in env.items() if not k.startswith("HERALD_") and k != "PYTEST_CURRENT_TEST"}


class ForkedProcess:
    """What the tests use of ``subprocess.Popen``, for a process forked by the server (whose
    child it is, so its exit status comes from the server)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited since; its status is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The test process's end: starts the server, asks it for processes, learns their exits."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self._base_env = _forkable(os.environ)
        self._process = subprocess.Popen([sys.executable, "-m", "tests.forkserver", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self._socket = ours
        self._lines = ours.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()  # one request at a time: answers come in request order
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._closed = False
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self._lines:
            message = json.loads(line)
            with self._changed:
                if "started" in message:
                    self._started.append(message["started"])
                else:
                    self._exits[message["exited"]] = message["code"]
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedProcess | subprocess.Popen[bytes]:
        """``python -m launcher.cli *argv`` with ``env``, its output appended to ``log``."""
        args = [sys.executable, "-m", "launcher.cli", *argv]
        if _forkable(env) != self._base_env or self._process.poll() is not None:
            with open(log, "ab") as out:
                return subprocess.Popen(args, env=env, stdout=out, stderr=out)
        request = json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n"
        with self._lock, self._changed:
            self._socket.sendall(request.encode())
            if not self._changed.wait_for(lambda: self._started or self._closed, timeout=30) or not self._started:
                raise RuntimeError(f"the fork server did not start {argv}")
            return ForkedProcess(self, self._started.pop(0), args)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._closed, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the server (processes it forked and still run are re-parented, not stopped)."""
        self._socket.shutdown(socket.SHUT_WR)  # its end of file: the server returns
        self._process.wait(10)
        self._socket.close()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def spawn(argv: list[str], env: dict[str, str], log: Path) -> ForkedProcess | subprocess.Popen[bytes]:
    """A Herald process, forked from this test process's server (started on first use)."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ForkServer()
    return _server.spawn(argv, env, log)


def close() -> None:
    """Stop this test process's server, if it started one (at the end of the session)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


# ----- the server ------------------------------------------------------------------------


class _BecomeChild(Exception):
    """Raised in a forked child: unwinds the server's frames (closing its socket) back to the
    top level, where the child runs Herald as ``python -m launcher.cli`` would."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__()
        self.request = request


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _serve(fd: int) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork copies only the forking thread
        raise SystemExit(f"forkserver: importing {PRELOAD} started threads; cannot fork")
    with socket.socket(fileno=fd) as conn:
        pending = b""
        while True:
            while True:  # reap every child that ended
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn.sendall(json.dumps({"exited": pid, "code": _returncode(status)}).encode() + b"\n")
            if not select.select([conn], [], [], REAP_EVERY_S)[0]:
                continue
            chunk = conn.recv(1 << 20)
            if not chunk:
                return  # the test process is gone
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    raise _BecomeChild(request)
                conn.sendall(json.dumps({"started": pid}).encode() + b"\n")


def _run_child(request: dict[str, Any]) -> int:
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    from launcher.cli import main

    sys.argv = [sys.modules[main.__module__].__file__ or "", *request["argv"]]
    return main(request["argv"])


if __name__ == "__main__":
    forked: dict[str, Any] | None = None
    try:
        _serve(int(sys.argv[1]))
    except _BecomeChild as child:
        forked = child.request  # out of the handler: a crash of Herald's is not chained to this
    if forked is not None:
        sys.exit(_run_child(forked))
