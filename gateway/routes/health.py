"""Liveness, readiness and metrics (no key needed)."""

from __future__ import annotations

from litestar import Request, Response, get

from gateway.openapi import problems
from gateway.problems import NotReady
from gateway.services import services
from herald.jobs import StoreUnwritable
from herald.kinds import declared_kinds
from herald.metrics import exposition


@get("/healthz", operation_id="healthz", tags=["operations"], summary="The process is alive", security=[])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", operation_id="readyz", tags=["operations"], summary="Store open and NATS connected",
     responses=problems(503), security=[])
async def readyz(request: Request) -> dict[str, str]:
    svc = services(request)
    try:
        await svc.store.ping()
    except StoreUnwritable as exc:
        raise NotReady(str(exc)) from exc
    except Exception as exc:
        raise NotReady("the job store is not reachable") from exc
    if svc.nats is None or not svc.nats.is_connected:
        raise NotReady("NATS is not connected", retry_after=1)
    return {"status": "ready"}


@get("/metrics", operation_id="metrics", tags=["operations"], summary="Prometheus metrics", security=[],
     media_type="text/plain")
async def metrics(request: Request) -> Response[bytes]:
    svc = services(request)
    try:
        stats = await svc.store.stats()
        queued_ages = await svc.store.queued_ages(list(declared_kinds()))
    except Exception:  # the store's own gauges are left out while it is unreachable, not the rest
        stats, queued_ages = None, None
    body = exposition(stats, queued_ages)
    return Response(body, media_type="text/plain; version=0.0.4")  # Litestar adds the charset to text/*
