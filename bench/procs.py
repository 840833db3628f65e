"""Every process the bench starts: on 127.0.0.1, on a free port, logging into the run's temp dir.

``Procs`` owns them and stops them all (SIGTERM, then SIGKILL) when its ``with`` block
ends, whatever happened; each child also gets SIGTERM if the bench itself dies
(PR_SET_PDEATHSIG), so an interrupted run leaves nothing behind. CPU time and RSS are
read from ``/proc`` for a process and all its descendants (nginx's workers).
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from launcher.cluster import bindable

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """Something the bench needs did not start or answer; the message says what."""


# Below the kernel's range for outgoing connections' local ports (32768 on): a port that
# bind(0) hands out there can be taken by any connection made before the server binds it.
# Apart from the test harness's bands (tests/harness.py, just under 32768).
_PORTS = range(10_000, 20_000)


def free_port() -> int:
    """A port no server listens on now, picked at random below the ephemeral range."""
    for _ in range(1000):
        port = random.choice(_PORTS)
        if bindable(port):
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the bench dies, even by kill -9."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    todo.extend(int(child) for child in handle.read().split())
        except OSError:
            continue
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its descendants, in seconds."""
    total = 0
    for each in descendants(pid):
        try:
            with open(f"/proc/{each}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / CLOCK_TICKS


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` and its descendants, in KiB."""
    total = 0
    for each in descendants(pid):
        try:
            with open(f"/proc/{each}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@dataclass
class PidGroup:
    """Processes the bench did not start itself (PostgreSQL, ``herald up --cluster``'s children),
    measured like a ``Proc``: CPU and RSS of each pid and its descendants, summed."""

    name: str
    pids: list[int]

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids)

    def rss_kib(self) -> int:
        return sum(rss_kib(pid) for pid in self.pids)


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found.extend(int(child) for child in handle.read().split())
    except OSError:
        pass
    return found


@dataclass
class Procs:
    """Starts processes and guarantees they are stopped (newest first) when the block ends."""

    root: Path
    started: list[Proc] = field(default_factory=list)
    profile: frozenset[str] = frozenset()  # roles to run py-spy on (see bench/profile.py)
    profile_dir: Path | None = None
    profiles: list[Path] = field(default_factory=list)

    def __enter__(self) -> Procs:
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              stop_signal: int = signal.SIGTERM) -> Proc:
        log = self.root / f"{name}.log"
        with open(log, "ab") as handle:
            popen = subprocess.Popen(list(argv), env=dict(env) if env is not None else None, stdout=handle,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        proc = Proc(name, popen, log)
        proc.stop_signal = stop_signal  # type: ignore[attr-defined]
        self.started.append(proc)
        if self.profile_dir is not None and any(name.endswith("-" + role) or name.rstrip("0123456789").endswith(
                "-" + role) for role in self.profile):
            self._attach_profiler(proc)
        return proc

    def _attach_profiler(self, proc: Proc) -> None:
        from bench.profile import record_argv

        assert self.profile_dir is not None
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        output = self.profile_dir / f"{proc.name}.txt"
        index = 1
        while output.exists() or output in self.profiles:
            index += 1
            output = self.profile_dir / f"{proc.name}-{index}.txt"
        self.profiles.append(output)
        log = self.root / f"py-spy-{output.stem}.log"
        with open(log, "ab") as handle:
            # Not in ``started``: py-spy ends by itself when its target exits, and writes then.
            subprocess.Popen(record_argv(proc.pid, output), stdout=handle, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def stop(self, proc: Proc) -> None:
        proc.stop(getattr(proc, "stop_signal", signal.SIGTERM), getattr(proc, "stop_timeout", 10.0))
        if proc in self.started:
            self.started.remove(proc)

    def stop_all(self) -> None:
        while self.started:
            self.stop(self.started[-1])


def wait_until(predicate: Callable[[], object], *, timeout: float, what: str, proc: Proc | None = None,
               interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise BenchError(f"{proc.name} exited while waiting for {what}; log: {proc.log}\n{proc.log_text()[-2000:]}")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(interval)
    tail = f"; log: {proc.log}\n{proc.log_text()[-2000:]}" if proc is not None else ""
    raise BenchError(f"timed out after {timeout:g} s waiting for {what}{tail}")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def http_get(url: str, headers: Mapping[str, str] | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (loopback only)
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post_json(url: str, document: object, headers: Mapping[str, str] | None = None,
                   timeout: float = 10.0) -> tuple[int, object]:
    import json

    request = urllib.request.Request(url, data=json.dumps(document).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (loopback only)
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def http_ok(url: str) -> bool:
    try:
        return http_get(url, timeout=1.0)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


class CpuMeter:
    """CPU used by a set of processes between ``start()`` and ``stop()``, as % of one core."""

    def __init__(self, procs: Mapping[str, Proc]) -> None:
        self.procs = dict(procs)
        self._start: dict[str, float] = {}
        self._t0 = 0.0
        self.result: dict[str, float] = {}
        self.seconds: dict[str, float] = {}  # each process's CPU seconds between start and stop
        self.wall_s = 0.0

    def start(self) -> CpuMeter:
        self._t0 = time.monotonic()
        self._start = {name: proc.cpu_seconds() for name, proc in self.procs.items()}
        return self

    def stop(self) -> dict[str, float]:
        wall = max(1e-6, time.monotonic() - self._t0)
        self.wall_s = wall
        self.seconds = {name: proc.cpu_seconds() - self._start[name] for name, proc in self.procs.items()}
        self.result = {name: round(100 * seconds / wall, 1) for name, seconds in self.seconds.items()}
        return self.result
