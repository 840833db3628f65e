"""The Litestar application and its lifespan (store, NATS, relay, hub, sweeper)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from litestar import Litestar
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme

import herald
from gateway.hub import Hub
from gateway.middleware import bind_job_context, instrument
from gateway.openapi import complete_document
from gateway.problems import handle_http_exception, handle_unexpected
from gateway.ratelimit import BacklogGuard, TenantLimits
from gateway.routes import events, health, jobs, page
from gateway.routes.accept import accept_route
from gateway.routes.results import result_route
from gateway.routes.webhooks import WebhooksController, webhooks_lifespan
from gateway.services import Services
from herald import jetstream
from herald.logs import log_transition
from herald.metrics import metrics as process_metrics
from herald.relay import Relay
from herald.results import FileResultStore
from herald.settings import Settings
from herald.signing import UrlSigner
from herald.store import Store
from herald.sweeper import run_sweeper
from workers import registry

log = logging.getLogger("herald.gateway")

MAX_BODY_BYTES = 1024 * 1024


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _connect_nats(svc: Services, tasks: list[asyncio.Task[None]]) -> None:
    """Connect (retrying until NATS is there), then start the relay and attach the hub.

    Until then the gateway still accepts jobs: the outbox keeps them.
    """

    async def reconnected() -> None:
        log.info("NATS reconnected")
        svc.hub.resync()

    while True:
        try:
            nc = await jetstream.connect(svc.settings, name="herald-gateway", reconnected=reconnected)
            break
        except Exception as exc:
            log.warning("NATS not reachable yet, retrying: %s", exc)
            await asyncio.sleep(0.5)
    js = nc.jetstream()
    await jetstream.ensure_topology(js, svc.settings)
    svc.nats = nc
    await svc.hub.attach(nc)
    relay = Relay(svc.store, js, sweep_interval_s=svc.settings.sweep_interval_s)
    relay.kick()
    tasks.append(asyncio.create_task(relay.run(), name="relay"))


def create_app(settings: Settings) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            store = await Store(settings.db_path, retention_s=settings.retention_s).open()
            stack.push_async_callback(store.close)
            metrics = process_metrics()
            hub = Hub(metrics)
            store.on_commit(metrics.observe)
            store.on_commit(log_transition)
            store.on_commit(lambda _job, event: hub.publish(event))
            svc = Services(
                settings=settings,
                store=store,
                results=FileResultStore(settings.results_dir),
                signer=UrlSigner(settings.signing_keys(), settings.signed_url_ttl_s),
                metrics=metrics,
                limiter=TenantLimits(settings.rate_limit, settings.max_held_per_tenant),
                hub=hub,
                backlog=BacklogGuard(store.oldest_queued_age, settings.max_queue_age_s),
            )
            app.state.services = svc
            tasks: list[asyncio.Task[None]] = [
                asyncio.create_task(run_sweeper(store, svc.results, settings), name="sweeper"),
            ]
            tasks.append(asyncio.create_task(_connect_nats(svc, tasks), name="nats-connect"))
            stack.push_async_callback(_cancel, tasks)

            async def close_nats() -> None:
                await hub.detach()
                if svc.nats is not None:
                    with contextlib.suppress(Exception):
                        await svc.nats.drain()

            stack.push_async_callback(close_nats)
            log.info("gateway ready", extra={"host": settings.http_host, "port": settings.http_port})
            yield

    kinds = registry.kinds().values()
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
            *(accept_route(kind) for kind in kinds),
            *(result_route(kind) for kind in kinds),
            WebhooksController,
            page.index,
            page.asset,
        ],
        lifespan=[lifespan, webhooks_lifespan],
        before_request=bind_job_context,
        exception_handlers={HTTPException: handle_http_exception, Exception: handle_unexpected},
        request_max_body_size=MAX_BODY_BYTES,
        openapi_config=OpenAPIConfig(
            title="Herald",
            version=herald.__version__,
            description="Asynchronous request-reply gateway: start work with 202 Accepted, then poll, "
            "long-poll, stream (SSE) or receive signed webhooks.",
            path="/schema",
            components=Components(
                security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer", description="API key")}
            ),
        ),
        logging_config=None,  # herald.logs configures logging once per process
        debug=False,
    )
    complete_document(app, kinds)
    return instrument(app)
