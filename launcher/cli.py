"""The ``herald`` command: run the whole system or one component."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any
import signal
import socket
import sys
import threading

import uvloop

from herald.kinds import KindError, load_kinds
from herald.logs import configure_logging
from herald.settings import Settings, SettingsError, check_exposed_api_keys


def _settings(args: argparse.Namespace) -> Settings:
    settings = Settings.from_env()
    changes = {}
    if getattr(args, "port", None) is not None:
        changes["http_port"] = args.port
    if getattr(args, "host", None) is not None:
        changes["http_host"] = args.host
    if getattr(args, "workers", None) is not None:
        changes["workers"] = args.workers
    if getattr(args, "kinds", None) is not None:
        changes["worker_kinds"] = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if getattr(args, "concurrency", None) is not None:
        changes["worker_concurrency"] = max(1, args.concurrency)
    return settings.with_changes(**changes) if changes else settings


CANNOT_RUN = 2  # the exit status of a process whose setup no waiting mends (as a wrong setting's)


def server_config(app: Any, host: str, port: int) -> Any:
    """The HTTP server settings of a gateway (the benchmark's baseline app uses them too)."""
    import uvicorn

    from gateway.headers import HttpProtocol

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=3,
        loop="uvloop",
        # httptools (with a bound on unfinished heads), not h11: ~15 % less CPU per request;
        # header names go out lower-case (gateway/headers.py, bench/RESULTS.md issue 14).
        http=HttpProtocol,
    )


def run_gateway(settings: Settings) -> int:
    from gateway.app import create_app
    from gateway.headers import edge
    from launcher.gateway_server import GatewayServer
    from launcher.open_files import raise_open_files_limit

    open_files = raise_open_files_limit()
    if open_files < 2 * settings.max_held_per_tenant:
        logging.getLogger("herald.gateway").warning(
            "this process may open %d files; one tenant may hold %d streams (HERALD_MAX_HELD_PER_TENANT): "
            "raise the hard limit (ulimit -Hn) or lower that", open_files, settings.max_held_per_tenant)

    # Called once the server runs (from the lifespan's NATS task), when ``server`` is set.
    app = edge(create_app(settings, give_up=lambda: server.give_up(CANNOT_RUN)))
    # Everything built so far (modules, classes, the app) lives as long as the process:
    # moved out of the collector's generations, it is no longer traversed by every
    # collection that the allocations of thousands of streams trigger (bench/RESULTS.md).
    gc.collect()
    gc.freeze()
    # A young generation of 10 000 objects instead of 700: fanning one event out to
    # thousands of streams allocates tens of thousands of short-lived objects, and every
    # 100th young collection walks all the streams' long-lived ones (a pause of tens of ms
    # at 1 000 streams, hundreds at 5 000). Only cyclic garbage waits longer to be freed.
    gc.set_threshold(10_000, 10, 10)
    config = server_config(app, settings.http_host, settings.http_port)
    server = GatewayServer(config)  # a stop on SIGINT/SIGTERM returns here: exit 0 (launcher/gateway_server.py)
    if not settings.http_reuse_port:
        server.run()
    else:
        server.run(sockets=[shared_listener(settings.http_host, settings.http_port, config.backlog)])
    return server.exit_status


def shared_listener(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket that shares its address with every other one bound with
    SO_REUSEPORT (by the same user): the kernel spreads new connections over them all.
    uvicorn serves it as given (``Server.run(sockets=...)``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


Component = Callable[[Settings, asyncio.Event], Awaitable[None]]


STOP_DEADLINE_S = 10.0  # past the worker's grace: the most a clean stop may take


def _exit_if_still_running(deadline_s: float) -> None:
    """A stop that hangs (a NATS call with no timeout during a reconnect, say) must not keep
    the process alive: everything it committed is in the store, so exiting loses nothing."""

    def give_up() -> None:
        logging.getLogger("herald").error("shutdown took longer than %.0f s; exiting now", deadline_s)
        logging.shutdown()
        os._exit(3)

    timer = threading.Timer(deadline_s, give_up)
    timer.daemon = True  # a clean stop exits without waiting for it
    timer.start()


def run_component(settings: Settings, body: Component) -> int:
    """Run a component without an API (worker, notifier) until SIGINT/SIGTERM sets its stop event."""
    from herald.jetstream import JetStreamNotEnabled
    from launcher.metrics_server import serve_metrics

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def request_stop() -> None:
            if not stop.is_set():
                _exit_if_still_running(settings.worker_grace_s + STOP_DEADLINE_S)
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, request_stop)
        async with serve_metrics(settings):
            try:
                await body(settings, stop)
            except JetStreamNotEnabled as exc:  # the body has closed what it opened on its way out
                logging.getLogger("herald.nats").error("%s; stopping", exc)
                return CANNOT_RUN
        return 0

    # uvloop, as the gateway's uvicorn: each turn of its loop costs a worker or a notifier
    # less than asyncio's own (bench/RESULTS.md, issue 24).
    return uvloop.run(main())


def run_worker(settings: Settings) -> int:
    from workers.runner import run_worker as body

    return run_component(settings, body)


def run_notifier(settings: Settings) -> int:
    from notifier.service import run_notifier as body

    return run_component(settings, body)


def _load_kinds(settings: Settings, command: str) -> None:
    """Every process finds its job kinds at start, so a clash or a broken entry point stops
    it here, by name. Processes that run handlers (``worker``; ``up``, which starts
    workers) also import the handlers they will serve now, not at the first job."""
    load_kinds(settings.kinds)
    if command in ("worker", "up"):
        from workers import registry

        registry.load(settings)


def list_kinds(settings: Settings, *, check: bool) -> int:
    """``herald kinds``: name, path, media types, handler and where each kind was declared."""
    from herald.kinds import declared_kinds, kind_origins

    origins = kind_origins()
    for name, kind in sorted(declared_kinds().items()):
        print(f"{name}  POST {kind.collection}  ->  {', '.join(kind.all_media_types) or 'application/json'}")
        print(f"    params {kind.params.__module__}.{kind.params.__qualname__}, handler {kind.handler}")
        print(f"    from {origins[name]}")
    if check:
        from workers import registry

        try:
            served = registry.load(settings.with_changes(worker_kinds=()))
        except KindError as exc:
            print(f"herald: {exc}", file=sys.stderr)
            return 2
        print(f"every handler imports ({len(served)} kinds)")
    return 0


def reencrypt_secrets(settings: Settings) -> int:
    """``herald secrets reencrypt``: every secret in the store sealed under the first key of
    HERALD_SECRET_KEY, so the keys after it can be dropped (the README's rotation steps)."""
    from herald.sealing import SealError
    from herald.storage import open_storage

    async def run() -> int:
        storage = await open_storage(settings)
        try:
            return await storage.jobs.reseal_secrets()
        finally:
            await storage.close()

    try:
        changed = asyncio.run(run())
    except SealError as exc:
        print(f"herald: {exc}", file=sys.stderr)
        return 2
    print(f"re-encrypted {changed} secret(s) under the first key of HERALD_SECRET_KEY")
    return 0


def _check_secret_key(settings: Settings) -> None:
    """A process that opens the store needs its secret key, before anything starts
    (PostgreSQL: HERALD_SECRET_KEY; SQLite: that, or the key file, made here once)."""
    from herald.sealing import KEY_FILE, SealError, load_sealer
    from herald.storage.sqlite.resealing import check_file_keys

    sealer = load_sealer(settings)
    if not settings.uses_postgres:
        try:
            check_file_keys(settings.db_path, sealer)
        except SealError as exc:
            key_file = settings.data_dir / KEY_FILE
            hint = (f"; {key_file} holds the key Herald made for this store when HERALD_SECRET_KEY was unset"
                    if settings.secret_keys and key_file.exists() else "")
            raise SettingsError(f"{exc}{hint}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="herald", description="Herald: asynchronous request-reply gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run everything: nats-server, gateway, workers, notifier")
    up.add_argument("--port", type=int, help="HTTP port (HERALD_HTTP_PORT)")
    up.add_argument("--host", help="HTTP host (HERALD_HTTP_HOST)")
    up.add_argument("--workers", type=int, help="worker processes (HERALD_WORKERS)")
    up.add_argument(
        "--cluster",
        action="store_true",
        help="rehearse a multi-machine deployment: 3 NATS nodes (R3), PostgreSQL, 2 gateways, 2 workers, 2 notifiers",
    )
    up.add_argument("--postgres-port", type=int, help="with --cluster: PostgreSQL's port (default 5432 if free, else a free one)")
    gateway = sub.add_parser("gateway", help="run the HTTP API (with relay, sweeper, retention)")
    gateway.add_argument("--port", type=int)
    gateway.add_argument("--host")
    worker = sub.add_parser("worker", help="run one worker process")
    worker.add_argument("--kinds", help="serve only these job kinds, comma-separated (HERALD_WORKER_KINDS); default: all")
    worker.add_argument("--concurrency", type=int, help="jobs this process runs at once (HERALD_WORKER_CONCURRENCY)")
    kinds = sub.add_parser("kinds", help="list the installed job kinds (and check that their handlers import)")
    kinds.add_argument("--check", action="store_true", help="import every handler, as a worker does at start")
    sub.add_parser("notifier", help="run one webhook notifier process")
    secrets_cmd = sub.add_parser("secrets", help="the store's sealed secrets (HERALD_SECRET_KEY)")
    secrets_sub = secrets_cmd.add_subparsers(dest="secrets_command", required=True)
    secrets_sub.add_parser("reencrypt", help="re-seal every secret in the store under the first key of HERALD_SECRET_KEY")
    with contextlib.suppress(ImportError):
        from launcher.client_cli import add_client_commands

        add_client_commands(sub)
    from launcher.admin_cli import add_admin_commands

    add_admin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "handler"):  # client commands bring their own handler
        return int(args.handler(args))
    try:
        settings = _settings(args)
        if args.command in ("gateway", "up"):  # a gateway listens: beyond loopback, no short key
            check_exposed_api_keys(settings)
        if args.command in ("gateway", "worker", "notifier", "secrets") or (
                args.command == "up" and not args.cluster):  # --cluster makes one for all its processes
            _check_secret_key(settings)
    except SettingsError as exc:
        print(f"herald: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings, args.command)
    if args.command in ("gateway", "worker", "notifier"):
        from herald import tracing

        tracing.configure(args.command, settings.instance)  # only if OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        _load_kinds(settings, args.command)
    except KindError as exc:
        print(f"herald: {exc}", file=sys.stderr)
        return 2
    if args.command == "kinds":
        return list_kinds(settings, check=args.check)
    if args.command == "secrets":
        return reencrypt_secrets(settings)
    if args.command == "up" and args.cluster:
        from launcher.cluster_up import run_cluster

        return run_cluster(settings, postgres_port=args.postgres_port)
    if args.command == "up":
        from launcher.supervisor import run_up

        return run_up(settings)
    if args.command == "gateway":
        return run_gateway(settings)
    if args.command == "worker":
        return run_worker(settings)
    if args.command == "notifier":
        return run_notifier(settings)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
