"""``/metrics`` for processes that serve no API (workers, notifiers), on HERALD_METRICS_PORT."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import start_http_server

from herald.metrics import process_registry
from herald.settings import Settings


@asynccontextmanager
async def serve_metrics(settings: Settings) -> AsyncIterator[None]:
    if settings.metrics_port is None:
        yield
        return
    server, thread = start_http_server(settings.metrics_port, addr=settings.http_host, registry=process_registry())
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
