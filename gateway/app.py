"""The Litestar application and its lifespan (store, NATS, relay, hub, sweeper)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from litestar import Litestar
from nats.aio.client import Client as NATS
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme

import herald
from gateway.hub import Hub
from gateway.middleware import before_request, instrument
from gateway.openapi import complete_document
from gateway.problems import handle_http_exception, handle_unexpected
from gateway.queueing import QueueReasons
from gateway.ratelimit import BacklogGuard, TenantLimits, held_budget
from gateway.routes import apidocs, events, health, jobs, output, page, portal
from gateway.routes.accept import accept_route
from gateway.routes.admin import AdminController
from gateway.routes.results import result_route
from gateway.routes.webhooks import WebhooksController
from gateway.services import Services
from herald import jetstream
from herald.directory import Directory
from herald.logs import log_transition
from herald.output import purge as purge_output
from herald.metrics import metrics as process_metrics
from herald.relay import Relay
from herald.resolver import Resolver
from herald.settings import Settings
from herald.signing import UrlSigner
from herald.storage import build_storage
from herald.storage.results import open_result_store
from herald.sweeper import run_sweeper
from herald.tasks import TaskOwner, until_done
from herald.kinds import load_kinds

log = logging.getLogger("herald.gateway")

MAX_BODY_BYTES = 1024 * 1024


async def _connect_nats(svc: Services, owner: TaskOwner, stop: asyncio.Event, give_up: Callable[[], None]) -> None:
    """Connect (retrying until NATS is there), create the topology (retrying until it is
    there), then start the relay and the sweeper and attach the hub. ``stop`` (the gateway
    is stopping) ends it at any of these steps, at once.

    Until then the gateway still accepts jobs: the outbox keeps them; /readyz says 503. A
    NATS without JetStream never becomes ready, so the gateway stops instead (``give_up``),
    saying so in one line, rather than accepting jobs no worker will ever get.
    """

    async def reconnected() -> None:
        log.info("NATS reconnected")
        svc.hub.resync()
        svc.watch.resync()

    nc = await jetstream.connect_until_ready(svc.settings, "herald-gateway", stop=stop, reconnected=reconnected)
    if nc is None:
        return
    js = nc.jetstream()
    try:
        while not stop.is_set():
            try:
                await jetstream.until_stopped(jetstream.ensure_topology(js, svc.settings), stop)
                if svc.settings.effective_result_store == "nats":
                    svc.results = await jetstream.until_stopped(open_result_store(svc.settings, js), stop)
                break
            except jetstream.Stopped:
                break
            except jetstream.JetStreamNotEnabled as exc:
                logging.getLogger("herald.nats").error("%s; stopping", exc)  # as a worker's and a notifier's line
                await _close_quietly(nc)
                give_up()
                return
            except Exception:  # a cluster without a JetStream leader yet, a node restarting
                log.exception("creating the JetStream streams and consumers failed; retrying in 1 s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
    except BaseException:
        await _close_quietly(nc)
        raise
    if stop.is_set() or owner.closing:  # the gateway began stopping while NATS was connecting (a port taken, a signal)
        await _close_quietly(nc)
        return
    # Retention deletes results, so the sweeper starts once the result store is reachable.
    owner.spawn(run_sweeper(svc.store, svc.results, svc.settings, functools.partial(purge_output, js)), "sweeper")
    svc.nats = nc
    await svc.directory.attach(nc)
    await svc.hub.attach(nc)
    await svc.watch.attach(nc)
    relay = Relay(svc.store, nc, sweep_interval_s=svc.settings.sweep_interval_s)
    relay.kick()
    owner.spawn(relay.run(), "relay")
    log.info("NATS connected, streams ready")


async def _close_quietly(nc: NATS) -> None:
    with contextlib.suppress(Exception):
        await nc.close()


async def _open_store(svc: Services, owner: TaskOwner, give_up: Callable[[], None]) -> None:
    """Open (or wait for) the store, load the URL signing key and the tenant directory, then
    start what needs them. A read that fails (the connection under it cut: a failover, a
    proxy, pg_terminate_backend) is tried again (``until_done``): given up, the gateway never
    connected to NATS, so it stayed unready until restarted, refused every key made over
    /admin (503) and let in the keys of disabled tenants from HERALD_API_KEYS."""
    await svc.store.open()

    async def load() -> None:
        if not svc.signer.ready:
            svc.signer.set_keys((await svc.store.signing_key(),))
        await svc.directory.refresh(force=True)

    await until_done(load, "reading the URL signing key and the tenant directory", log)
    owner.spawn(svc.directory.run(), "tenant-directory")
    connecting = asyncio.Event()  # set: stop connecting (the gateway is stopping)
    owner.spawn(_connect_nats(svc, owner, connecting, give_up), "nats-connect", stop=connecting.set)


def _keep_serving() -> None:
    """``create_app``'s ``give_up`` by default: serve on, not ready (/readyz 503)."""


def create_app(settings: Settings, *, give_up: Callable[[], None] = _keep_serving) -> Litestar:
    """The gateway's app; ``give_up`` stops its server when it cannot serve at all (NATS
    without JetStream): ``herald gateway`` then exits non-zero (launcher/cli.py)."""
    # The kinds' declarations only: a gateway never imports a handler (or its dependencies).
    kinds = list(load_kinds(settings.kinds).values())

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with TaskOwner() as owner:
            storage = build_storage(settings)
            store = storage.jobs
            owner.push_async_callback(storage.close)
            resolver = Resolver(settings.webhook_dns_servers)
            owner.push_async_callback(resolver.close)
            metrics = process_metrics()
            hub = Hub(metrics)
            directory = Directory(settings, storage.tenants, storage.sealer)
            store.on_commit(metrics.observe)
            store.on_commit(log_transition)
            store.on_commit(lambda _job, event: hub.publish(event))
            svc = Services(
                settings=settings,
                storage=storage,
                store=store,
                # The NATS result store is attached once NATS is connected (_connect_nats).
                results=await open_result_store(settings, None),
                signer=UrlSigner(settings.configured_signing_keys(), settings.signed_url_ttl_s),
                metrics=metrics,
                limiter=TenantLimits(directory, held_budget()),
                limits=directory,
                hub=hub,
                directory=directory,
                backlog=BacklogGuard(store.tenant_queued_age, settings.max_queue_age_s),
                queue_reasons=QueueReasons(store, directory),
                resolver=resolver,
            )
            app.state.services = svc
            opening = owner.spawn(_open_store(svc, owner, give_up), "store-open")
            if not settings.uses_postgres:
                await opening  # a local file: open before serving. PostgreSQL may take a while: /readyz says 503 meanwhile

            async def close_nats() -> None:
                await directory.detach()
                await hub.detach()
                await svc.watch.detach()
                if svc.nats is not None:
                    with contextlib.suppress(Exception):
                        await svc.nats.drain()

            owner.push_async_callback(close_nats)
            if settings.admin_key is None:
                log.warning("the admin API is off: every /admin route answers 401 (set HERALD_ADMIN_KEY to turn it on)")
            if not settings.api_keys:
                log.info("no HERALD_API_KEYS: only the tenants and keys created through /admin can call the API")
            log.info("gateway ready", extra={"host": settings.http_host, "port": settings.http_port})
            yield

    app = Litestar(
        route_handlers=[
            health.healthz,
            health.readyz,
            health.metrics,
            jobs.get_job,
            jobs.list_jobs,
            jobs.cancel_job,
            events.job_events,
            events.tenant_events,
            events.events_link,
            output.job_output,
            *(accept_route(kind) for kind in kinds),
            *(result_route(kind) for kind in kinds),
            WebhooksController,
            AdminController,
            page.index,
            page.asset,
            portal.portal_page,
            portal.portal_link,
            portal.portal_session,
        ],
        lifespan=[lifespan],
        before_request=before_request,
        exception_handlers={HTTPException: handle_http_exception, Exception: handle_unexpected},
        request_max_body_size=MAX_BODY_BYTES,
        openapi_config=OpenAPIConfig(
            title="Herald",
            version=herald.__version__,
            description="Asynchronous request-reply gateway: start work with 202 Accepted, then poll, "
            "long-poll, stream (SSE) or receive signed webhooks.",
            path=apidocs.SCHEMA_PATH,
            render_plugins=apidocs.render_plugins(),
            openapi_router=apidocs.schema_router(),
            components=Components(
                security_schemes={
                    "bearer": SecurityScheme(type="http", scheme="bearer", description="API key"),
                    "admin": SecurityScheme(type="http", scheme="bearer", description="the operator's HERALD_ADMIN_KEY"),
                    "portal": SecurityScheme(type="http", scheme="bearer", bearer_format="hps_…",
                                             description="portal session token (POST /portal/session): "
                                             "the tenant's /webhooks routes only"),
                }
            ),
        ),
        logging_config=None,  # herald.logs configures logging once per process
        debug=False,
    )
    complete_document(app, kinds)
    return instrument(app)
