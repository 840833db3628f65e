"""The edge of the HTTP server, around the whole app: request-head limits.

* A request head over ``MAX_HEADER_BYTES`` (path, query and headers) is refused with
  ``431`` before the app sees it (``edge``).
* A head still incomplete after ``MAX_RAW_HEAD_BYTES`` have arrived (sent in pieces, or
  one endless header) is refused with ``431`` by the server's protocol (``HttpProtocol``)
  and the connection closed: httptools would otherwise keep collecting it without bound.
* A head still incomplete ``HEAD_WITHIN_S`` after its connection opened (or after its
  request's first byte, on a connection kept alive) is refused with ``408`` and the
  connection closed, as nginx's ``client_header_timeout`` does: the server bounds no head
  in time, so a head sent a byte now and then, or never finished, held its connection for
  as long as the client wanted. A connection that sent nothing by then is closed without an
  answer. (A body is bounded where it is read: ``gateway.bodies``.)
* A head httptools cannot parse at all is answered ``400`` as problem+json, as every
  other error is (``HttpProtocol.send_400_response``).
* An answer whose client takes none of it for ``SEND_WITHIN_S`` (the connection's write
  buffer stays above its high-water mark) has its connection reset, as nginx's
  ``send_timeout`` does: the server bounds no write in time, so a client that stopped reading
  a download (a result, a job's NDJSON output) held its connection, its task and what the
  answer holds open (a file, a JetStream consumer) for as long as it kept the socket, and a
  tenant opening many such held the gateway's file descriptors, which every tenant's
  requests need (``gateway.sse`` drops a stalled event stream sooner, on its own bound).
* A response can abort its connection (``connection_abort(scope)``): a stream that drops a
  reader who stopped reading (``gateway.sse``) must not leave its socket open with megabytes
  queued, which is what ending the response does (uvicorn closes the transport, and a close
  waits for the write buffer to drain; the kernel then keeps sending what it holds).

Header names go out lower-cased (uvicorn's httptools protocol writes them so). Names are
case-insensitive (RFC 9110 §5.1); the gateway ran h11 only to keep their case, at ~15 % of
its CPU per request (bench/RESULTS.md, issue 14).

``HEAD`` is answered as ``GET`` without the body (``edge``), streams and downloads included.
So every ``Allow`` names HEAD wherever it names GET: an OPTIONS answer's (``edge``, which also
names every method of a route where the framework's names only its first handler's) and a
405's (``gateway.problems``). The GET it runs as keeps the method the client sent in its scope
(``SENT_METHOD``), which the access line and the request metrics name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from litestar import Litestar
from litestar.routes import HTTPRoute
from litestar.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.problems import PROBLEM_MEDIA_TYPE, allow
from schemas.problems import BAD_REQUEST, HEADERS_TOO_LARGE, REQUEST_TIMEOUT

log = logging.getLogger("herald.http")

ABORT_EXTENSION = "herald.abort"  # scope["extensions"][ABORT_EXTENSION]["abort"]: reset the connection now
SENT_METHOD = "herald.sent_method"  # scope[SENT_METHOD]: the client's method where the app runs another (HEAD as GET)
MAX_HEADER_BYTES = 16 * 1024
# Raw bytes count separators, the request line and line ends that the scope does not, so
# the cap on an unfinished head is looser; it bounds memory, ``edge`` enforces the limit.
MAX_RAW_HEAD_BYTES = 2 * MAX_HEADER_BYTES
REFUSED_LINGER_S = 2.0  # how long a refused connection is drained before it is closed
HEAD_WITHIN_S = 30.0  # the longest a request's head may take to arrive
SEND_WITHIN_S = 60.0  # the longest an answer's client may take none of what is queued for it
_TOO_LARGE = HEADERS_TOO_LARGE.problem(f"the request's headers exceed {MAX_HEADER_BYTES} bytes")
_TOO_LARGE_BODY = msgspec.json.encode(_TOO_LARGE)
_TOO_LARGE_HEADERS = [
    (b"content-type", PROBLEM_MEDIA_TYPE.encode()), (b"content-length", str(len(_TOO_LARGE_BODY)).encode()),
]


def _raw_answer(reason: str, body: bytes) -> bytes:
    """A problem answered by the protocol itself, before any app sees the request."""
    status = msgspec.json.decode(body)["status"]
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {PROBLEM_MEDIA_TYPE}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


_TOO_LARGE_RAW = _raw_answer("Request Header Fields Too Large", _TOO_LARGE_BODY)
_HEAD_TOO_SLOW_RAW = _raw_answer("Request Timeout", msgspec.json.encode(REQUEST_TIMEOUT.problem(
    f"the request's head did not arrive within {HEAD_WITHIN_S:g} s")))


def connection_abort(scope: Mapping[str, Any]) -> Callable[[], None] | None:
    """What resets the request's connection at once (``HttpProtocol`` puts it in the scope);
    None under another server."""
    extension = (scope.get("extensions") or {}).get(ABORT_EXTENSION)
    return extension.get("abort") if isinstance(extension, dict) else None


async def _refuse_large_head(send: Send) -> None:
    await send({"type": "http.response.start", "status": _TOO_LARGE.status or 500, "headers": _TOO_LARGE_HEADERS})
    await send({"type": "http.response.body", "body": _TOO_LARGE_BODY, "more_body": False})


class _HeadSent(BaseException):
    """A HEAD answer's head is out: the GET it ran as stops here. A BaseException, so that no
    ``except Exception`` on the way (the framework's error handler) mistakes it for a failure."""


async def _as_head(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """HEAD is GET without the body (RFC 9110 §9.3.2): the app answers the GET, its status and
    headers go out, and it is stopped at its first body (a stream would never end)."""

    async def head_only(message: Any) -> None:
        if message["type"] == "http.response.start":
            await send(message)
        elif message["type"] == "http.response.body":
            # uvicorn writes no body for a HEAD request; this ends the answer.
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise _HeadSent

    try:
        await app({**scope, "method": "GET", SENT_METHOD: "HEAD"}, receive, head_only)  # type: ignore[arg-type]
    except* _HeadSent:  # a file or a stream sends from a task group, which wraps it in a group
        pass


def allowed_methods(app: Litestar) -> dict[str, bytes]:
    """Each route's ``Allow``, by the path template the router leaves in the scope: the methods
    of all its handlers, HEAD wherever GET is, and OPTIONS."""
    methods: dict[str, set[str]] = {}
    for route in app.routes:
        if isinstance(route, HTTPRoute):
            methods.setdefault(route.path_format, set()).update(route.methods)
    return {template: allow(named).encode() for template, named in methods.items()}


async def _as_options(app: ASGIApp, allowed: Mapping[str, bytes], scope: Scope, receive: Receive, send: Send) -> None:
    """OPTIONS as the framework answers it (204, or 404 for no route), with an ``Allow`` that
    names every method of the route. Litestar's names only those of the route's first handler
    (its OPTIONS handler is made for the first one and kept when more join the path), and
    never HEAD, which ``edge`` answers."""

    async def complete(message: Any) -> None:
        if message["type"] == "http.response.start" and message["status"] < 300:
            value = allowed.get(scope.get("path_template", ""))
            if value is not None:
                headers = [(name, v) for name, v in message.get("headers", ()) if name.lower() != b"allow"]
                message = {**message, "headers": [*headers, (b"allow", value)]}
        await send(message)

    await app(scope, receive, complete)


def edge(app: Litestar) -> ASGIApp:
    allowed = allowed_methods(app)

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
            head += sum(len(name) + len(value) for name, value in scope["headers"])
            if head > MAX_HEADER_BYTES:
                await _refuse_large_head(send)
                return
            method = scope.get("method")
            if method == "HEAD":
                await _as_head(app, scope, receive, send)
                return
            if method == "OPTIONS":
                await _as_options(app, allowed, scope, receive, send)
                return
        await app(scope, receive, send)

    return middleware


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on an unfinished request head."""

    _in_head = False  # a request's first bytes arrived, its headers are not complete yet
    _head_bytes = 0
    _refused = False  # answered 431 or 408: what else arrives is dropped until the client closes
    _head_timer: asyncio.TimerHandle | None = None  # armed while a head is due
    _send_timer: asyncio.TimerHandle | None = None  # armed while writing is paused (the client takes nothing)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # the first head is due from the connection's opening

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = asyncio.get_running_loop().call_later(SEND_WITHIN_S, self._send_too_slow)

    def resume_writing(self) -> None:
        self._disarm_send_timer()
        super().resume_writing()

    def _disarm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_too_slow(self) -> None:
        """The client took nothing for ``SEND_WITHIN_S``: reset the connection (a close would wait
        for it to read what is queued, which it does not), which ends the answer's send."""
        self._send_timer = None
        if not self.transport.is_closing():
            log.warning("client took none of its answer in time: connection reset",
                        extra={"within_s": SEND_WITHIN_S, "path": getattr(self, "scope", {}).get("path")})
            self.abort_connection()

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()  # a later request's head, from its first byte (idle between: keep-alive's)
        super().on_message_begin()
        self.scope["extensions"] = {ABORT_EXTENSION: {"abort": self.abort_connection}}  # type: ignore[typeddict-unknown-key]

    def abort_connection(self) -> None:
        """Reset the connection now: what is queued for it is dropped, here and in the kernel
        (a lingering close with a zero timeout sends RST), and the app's ``receive`` answers
        ``http.disconnect`` from the next turn of the loop on."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def _arm_head_timer(self) -> None:
        self._head_timer = asyncio.get_running_loop().call_later(HEAD_WITHIN_S, self._head_too_slow)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A head pipelined behind an answer still being sent (a stream): no bytes of ours may
            # go between that answer's; the head is looked at again later.
            self._arm_head_timer()
            return
        if not self._in_head:
            # Not a byte of a request: closed as an idle connection kept alive is, without an
            # answer, which a client sending its request just then could take for that request's.
            self.transport.close()
            return
        self._refuse(_HEAD_TOO_SLOW_RAW)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_RAW_HEAD_BYTES:
                self._refuse(_TOO_LARGE_RAW)

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (raw non-ASCII in its target, a broken head) is
        answered as problem+json too, not uvicorn's plain text."""
        body = msgspec.json.encode(BAD_REQUEST.problem(f"the request could not be read: {msg.rstrip('.')}"))
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: " + PROBLEM_MEDIA_TYPE.encode() + b"\r\n",
                 b"content-length: " + str(len(body)).encode() + b"\r\n", b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    def _refuse(self, answer: bytes) -> None:
        # Closing at once with the client's bytes unread would reset the connection, and the
        # client might never read the answer: end our side, drop the rest, close soon.
        self._in_head = False
        self._refused = True
        self._disarm_head_timer()
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self.transport.close)
