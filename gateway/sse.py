"""Server-sent events on the wire: framing, and a streaming response that drops slow clients.

Litestar's ``Stream`` awaits each send for as long as the client takes; a client that
stops reading would hold its stream (and its queue) forever. ``EventStream`` bounds every
send: a client that cannot take one event within ``SEND_TIMEOUT_S`` is dropped, counted
and logged; so is one whose queue in the hub overflows (the hub counts it and ends the
stream through ``drop_handle``). A dropped client's connection is reset (what is queued
for it is thrown away), not closed: a close waits for the client to read it all, and one
that stopped reading never does. It reconnects with Last-Event-ID and misses nothing.

A stream lasts only while whoever opened it may (SPEC §12): the request's authentication
leaves a ``StreamOwner`` in ``request.state`` (``gateway.auth``), and the tenant directory
ends the stream once that key is revoked or expires, or its tenant is disabled. The
client's reconnect then gets the 401 any request with that key gets; so does a stream whose
key stopped holding between the route's check and the answer's start.

The response owns the stream's slot in the tenant's ``max_streams`` (``slot``, from
``TenantLimits.stream_slot``): it gives it back when it ends, whichever way it ends, also
when its body never starts (a refusal, a HEAD, a client already gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar import Request
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import HTTPResponseBodyEvent, Receive, Send

from gateway.headers import connection_abort
from gateway.problems import PROBLEM_MEDIA_TYPE
from herald.directory import StreamOwner
from herald.jobs import StoreUnavailable
from herald.metrics import metrics
from schemas import JobEvent
from schemas.problems import UNAUTHORIZED

log = logging.getLogger("herald.sse")

SEND_TIMEOUT_S = 10.0
# How long a stream that was told to end may go on before it is told again: a cancel can be
# lost (Python 3.11's asyncio.wait_for, inside nats-py's requests, returns the result when a
# cancel lands in the turn its answer arrives), and a stream that lost it would wait forever.
RECANCEL_S = 1.0
# How long a dropped reader's reset connection may take to be seen gone by the server, which
# otherwise logs an error for a response that ended without completing.
ABORT_WAIT_S = 1.0
KEEPALIVE_S = 15.0
RETRY_MS = 3000
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no", "Connection": "keep-alive"}

STREAM_OWNER = "stream_owner"  # the request.state entry: a herald.directory.StreamOwner

RETRY_FRAME = f"retry: {RETRY_MS}\n\n".encode()
KEEPALIVE_FRAME = b": keep-alive\n\n"

_NO_LONGER_HOLDS = msgspec.json.encode(UNAUTHORIZED.problem(
    "this key was revoked or has expired, or its tenant was disabled"))
_NO_LONGER_HOLDS_HEADERS = [
    (b"content-type", PROBLEM_MEDIA_TYPE.encode()), (b"content-length", str(len(_NO_LONGER_HOLDS)).encode()),
    (b"cache-control", b"no-store"), (b"www-authenticate", b'Bearer realm="herald"'),
]


class Dropped(Exception):
    """Raised by a stream's body whose queue in the hub overflowed (the hub counted it): its
    reader stopped reading, and the response resets its connection."""


def frame(event_id: str | None, event_type: str, data: bytes) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event_type}\n".encode() + b"data: " + data + b"\n\n"


def job_frame(event: JobEvent, event_type: str | None = None) -> bytes:
    return frame(str(event.version), event_type or event.type, bytes(event.data))


def tenant_frame(event: JobEvent) -> bytes:
    return frame(str(event.seq), event.type, bytes(event.data))


class _Watchdog:
    """One timer for the sends of every stream of an event loop, not one per stream.

    It ticks every ``SEND_TIMEOUT_S / 2`` while any stream is open and drops a stream whose
    send has not completed over three ticks in a row (stuck for SEND_TIMEOUT_S to
    1.5 x SEND_TIMEOUT_S). A stream marks its sends with a counter and a flag, cheaper per
    chunk than reading the clock, and far cheaper than a cancel scope or a timeout per
    chunk (under fan-out those cost more than the send itself).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: set[_BoundedStreamingResponse] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, stream: _BoundedStreamingResponse) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests run several, one after the other)
            self._loop, self._streams, self._timer = loop, set(), None
        self._streams.add(stream)
        if self._timer is None:
            self._timer = loop.call_later(SEND_TIMEOUT_S / 2, self._tick)

    def discard(self, stream: _BoundedStreamingResponse) -> None:
        self._streams.discard(stream)

    def _tick(self) -> None:
        self._timer = None
        for stream in tuple(self._streams):
            stream.watch()
        if self._streams and self._loop is not None:
            self._timer = self._loop.call_later(SEND_TIMEOUT_S / 2, self._tick)


_watchdog = _Watchdog()
_streaming: contextvars.ContextVar[_BoundedStreamingResponse | None] = contextvars.ContextVar(
    "herald_sse_response", default=None)


def drop_handle() -> Callable[[], None] | None:
    """In a stream's body: what drops its reader at once, for the hub to call when the stream's
    queue overflows (the hub counts it), so that a reader stuck in a send is not left to the
    send bound (counted a second time). None outside a response (a body driven directly)."""
    response = _streaming.get()
    return None if response is None else functools.partial(response.end, "queue_full")


class _BoundedStreamingResponse(ASGIStreamingResponse):
    """Sends each chunk as it comes; ends when the iterator does, when the client goes away,
    or when a send does not complete in time (see ``_Watchdog``).

    Plain asyncio instead of Litestar's anyio task group per response (a group, its cancel
    scopes and two task handles for every held stream): the stream runs in the request's own
    task, and one small task waits for the client's disconnect and cancels it. A stream
    ended so is cancelled again every ``RECANCEL_S`` until its body has stopped: one cancel
    can be swallowed on its way (see ``RECANCEL_S``).
    """

    __slots__ = ("_task", "_sends", "_in_send", "_seen", "_strikes", "_ended_by", "_cancels", "_stopping", "_abort",
                 "owner", "slot")
    owner: StreamOwner | None  # set by EventStream: whom the stream was opened for
    slot: Callable[[], None] | None  # set by EventStream: gives the tenant's held-stream slot back

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.owner = self.slot = None
        self._abort: Callable[[], None] | None = None

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        try:
            self._abort = connection_abort(scope)
            owner = self.owner
            if owner is not None and not owner.directory.stream_allowed(owner.tenant, owner.key_id):
                # Revoked (or its tenant disabled) between the route's check and now: the 401 the
                # reconnect would get. Never a 200 with an empty body, which EventSource retries.
                await send({"type": "http.response.start", "status": 401, "headers": _NO_LONGER_HOLDS_HEADERS})
                await send({"type": "http.response.body", "body": _NO_LONGER_HOLDS, "more_body": False})
                return
            await super().__call__(scope, receive, send)
        finally:
            slot, self.slot = self.slot, None
            if slot is not None:
                slot()

    async def send_body(self, send: Send, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task, self._sends, self._in_send, self._seen, self._strikes = task, 0, False, -1, 0
        self._ended_by: str | None = None
        self._cancels, self._stopping = 0, False  # our cancels of the task; the body is past its loop
        owner = self.owner
        held = owner.directory.hold_stream(owner, lambda: self.end("revoked")) if owner is not None else None
        listener = asyncio.ensure_future(self._until_disconnect(receive))
        _watchdog.add(self)
        iterator = self.iterator
        streaming = _streaming.set(self)  # for drop_handle, in the body (it runs in this task)
        try:
            async for chunk in iterator:
                body = chunk if isinstance(chunk, bytes) else chunk.encode()
                self._sends += 1
                self._in_send = True
                await send(HTTPResponseBodyEvent(type="http.response.body", body=body, more_body=True))
                self._in_send = False
                del chunk, body  # an idle stream keeps no copy of what it sent last
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Dropped:
            self._stopping = True
            self._ended_by = self._ended_by or "queue_full"
        except StoreUnavailable as exc:
            # The store went away under a running stream: a clean end, not a server error (a
            # client can outwait it, SPEC §8). It reconnects after `retry:` and resumes.
            self._stopping = True
            log.warning("event stream ended: the store did not answer", extra={"detail": str(exc)})
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            self._stopping = True
            if self._ended_by is None:
                raise  # cancelled from outside (the server stopping): not ours to swallow
            if self._ended_by == "revoked":  # a clean end: the client reconnects, and learns why
                # Bounded as every send: a reader that stopped reading does not hold it for ever.
                closing = asyncio.ensure_future(send({"type": "http.response.body", "body": b"", "more_body": False}))
                if (await asyncio.wait((closing,), timeout=SEND_TIMEOUT_S))[0]:
                    closing.exception()  # retrieved: a client gone meanwhile is no error
                else:
                    closing.cancel()
                    self._ended_by = "send_timeout"  # dropped: counted, and its connection reset
        finally:
            self._stopping = True
            for _ in range(self._cancels):  # each of ours, also one that was swallowed on its way
                task.uncancel()
            if held is not None and owner is not None:
                owner.directory.release_stream(held)
            _watchdog.discard(self)
            if self._ended_by == "send_timeout":
                metrics().sse_dropped.labels(reason="send_timeout").inc()
                log.warning("SSE client too slow, dropped")
            if self._ended_by in ("send_timeout", "queue_full") and self._abort is not None:
                self._abort()  # reset: nothing more is written, nothing queued is kept (here or in the kernel)
                # Once the server has seen the connection go, the unfinished response is no error to it.
                await asyncio.wait((listener,), timeout=ABORT_WAIT_S)
            listener.cancel()
            _streaming.reset(streaming)
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # its own clean-up (unsubscribe, gauges) now, not when collected

    async def _until_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.end("disconnect")

    def watch(self) -> None:
        """A watchdog tick: the same send in flight over three ticks is stuck."""
        if not self._in_send:
            self._strikes = 0
        elif self._sends != self._seen:
            self._seen, self._strikes = self._sends, 1
        else:
            self._strikes += 1
            if self._strikes >= 3:
                self.end("send_timeout")

    def end(self, reason: str) -> None:
        """End the stream: ``disconnect``, ``revoked`` (a clean end), or its reader dropped
        (``send_timeout``, ``queue_full``: its connection is reset)."""
        if self._ended_by is None and not self._stopping:
            self._ended_by = reason
            self._cancel()

    def _cancel(self) -> None:
        """Cancel the stream's task, and again every ``RECANCEL_S`` until its body stopped."""
        if not self._stopping:
            self._cancels += 1
            self._task.cancel()
            asyncio.get_running_loop().call_later(RECANCEL_S, self._cancel)


class EventStream(Stream):
    """``text/event-stream`` with bounded sends and the SSE headers."""

    def __init__(self, iterator: AsyncIterator[bytes], *, slot: Callable[[], None] | None = None,
                 **kwargs: Any) -> None:
        """``slot``: the tenant's held-stream slot this stream takes (``TenantLimits.stream_slot``);
        the response gives it back when it ends, however it ends."""
        super().__init__(iterator, media_type="text/event-stream", headers=dict(SSE_HEADERS), **kwargs)
        self.slot = slot

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
        response = _BoundedStreamingResponse(
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
        response.owner = request.state.get(STREAM_OWNER)
        response.slot, self.slot = self.slot, None
        return response
