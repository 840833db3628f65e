"""Server-sent events on the wire: framing, and a streaming response that drops slow clients.

Litestar's ``Stream`` awaits each send for as long as the client takes; a client that
stops reading would hold its stream (and its queue) forever. ``EventStream`` bounds every
send: a client that cannot take one event within ``SEND_TIMEOUT_S`` is dropped, counted
and logged; it reconnects with Last-Event-ID and misses nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from litestar import Request
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import HTTPResponseBodyEvent, Receive, Send

from herald.metrics import metrics
from schemas import JobEvent

log = logging.getLogger("herald.sse")

SEND_TIMEOUT_S = 10.0
KEEPALIVE_S = 15.0
RETRY_MS = 3000
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no", "Connection": "keep-alive"}

RETRY_FRAME = f"retry: {RETRY_MS}\n\n".encode()
KEEPALIVE_FRAME = b": keep-alive\n\n"


def frame(event_id: str | None, event_type: str, data: bytes) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event_type}\n".encode() + b"data: " + data + b"\n\n"


def job_frame(event: JobEvent, event_type: str | None = None) -> bytes:
    return frame(str(event.version), event_type or event.type, bytes(event.data))


def tenant_frame(event: JobEvent) -> bytes:
    return frame(str(event.seq), event.type, bytes(event.data))


class _BoundedStreamingResponse(ASGIStreamingResponse):
    async def send_body(self, send: Send, receive: Receive) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self._send_bounded, send, group.cancel_scope)
            await self._listen_for_disconnect(cancel_scope=group.cancel_scope, receive=receive)

    async def _send_bounded(self, send: Send, scope: anyio.CancelScope) -> None:
        # One watchdog timer per stream, not a timeout per chunk: under fan-out a cancel
        # scope and a timer per event and subscriber cost more than the send itself. The
        # watchdog looks every SEND_TIMEOUT_S / 2, so a stuck send is dropped after
        # SEND_TIMEOUT_S to 1.5 x SEND_TIMEOUT_S.
        loop = asyncio.get_running_loop()
        sending_since: float | None = None
        timed_out = False
        watchdog: asyncio.TimerHandle | None = None

        def watch() -> None:
            nonlocal watchdog, timed_out
            if sending_since is not None and loop.time() - sending_since >= SEND_TIMEOUT_S:
                timed_out = True
                scope.cancel()
                return
            watchdog = loop.call_later(SEND_TIMEOUT_S / 2, watch)

        watchdog = loop.call_later(SEND_TIMEOUT_S / 2, watch)
        try:
            async for chunk in self.iterator:
                sending_since = loop.time()
                body = chunk if isinstance(chunk, bytes) else chunk.encode()
                await send(HTTPResponseBodyEvent(type="http.response.body", body=body, more_body=True))
                sending_since = None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if watchdog is not None:
                watchdog.cancel()
            if timed_out:
                metrics().sse_dropped.labels(reason="send_timeout").inc()
                log.warning("SSE client too slow, dropped")
            scope.cancel()


class EventStream(Stream):
    """``text/event-stream`` with bounded sends and the SSE headers."""

    def __init__(self, iterator: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(iterator, media_type="text/event-stream", headers=dict(SSE_HEADERS), **kwargs)

    def to_asgi_response(  # type: ignore[override]
        self,
        app: Any,
        request: Request,
        *,
        background: Any = None,
        cookies: Any = None,
        encoded_headers: Any = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: Any = None,
        status_code: int | None = None,
        type_encoders: Any = None,
    ) -> ASGIResponse:
        merged_headers = {**headers, **self.headers} if headers is not None else self.headers
        merged_cookies = self.cookies if cookies is None else itertools.chain(self.cookies, cookies)
        return _BoundedStreamingResponse(
            background=self.background or background,
            content_length=0,
            cookies=merged_cookies,
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers=merged_headers,
            is_head_response=is_head_response,
            iterator=self.iterator,  # type: ignore[arg-type]
            media_type="text/event-stream",
            status_code=self.status_code or status_code,
        )
