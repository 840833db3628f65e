"""The edge of the HTTP server, around the whole app: request-head limits.

* A request head over ``MAX_HEADER_BYTES`` (path, query and headers) is refused with
  ``431`` before the app sees it (``edge``).
* A head still incomplete after ``MAX_RAW_HEAD_BYTES`` have arrived (sent in pieces, or
  one endless header) is refused with ``431`` by the server's protocol (``HttpProtocol``)
  and the connection closed: httptools would otherwise keep collecting it without bound.

Header names go out lower-cased (uvicorn's httptools protocol writes them so). Names are
case-insensitive (RFC 9110 §5.1); the gateway ran h11 only to keep their case, at ~15 % of
its CPU per request (bench/RESULTS.md, issue 14).

A response whose length is known (``content-length``: a 202, a status, a problem) leaves in
one write, head and body together (``_OneWrite``). uvicorn writes the head as soon as the app
starts the response and the body when it comes, and uvloop sends each write at once: two
system calls, and on loopback two passes through the receiver's TCP path, both paid in the
gateway's time. A streamed response (SSE, chunked) still sends its head at once: its body
may be a while coming.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.problems import PROBLEM_MEDIA_TYPE
from schemas.problems import HEADERS_TOO_LARGE

MAX_HEADER_BYTES = 16 * 1024
# Raw bytes count separators, the request line and line ends that the scope does not, so
# the cap on an unfinished head is looser; it bounds memory, ``edge`` enforces the limit.
MAX_RAW_HEAD_BYTES = 2 * MAX_HEADER_BYTES
REFUSED_LINGER_S = 2.0  # how long a refused connection is drained before it is closed
_TOO_LARGE = HEADERS_TOO_LARGE.problem(f"the request's headers exceed {MAX_HEADER_BYTES} bytes")
_TOO_LARGE_BODY = msgspec.json.encode(_TOO_LARGE)
_TOO_LARGE_HEADERS = [
    (b"content-type", PROBLEM_MEDIA_TYPE.encode()), (b"content-length", str(len(_TOO_LARGE_BODY)).encode()),
]
_TOO_LARGE_RAW = (
    f"HTTP/1.1 {_TOO_LARGE.status} Request Header Fields Too Large\r\n".encode()
    + b"".join(name + b": " + value + b"\r\n" for name, value in _TOO_LARGE_HEADERS)
    + b"connection: close\r\n\r\n" + _TOO_LARGE_BODY
)


async def _refuse_large_head(send: Send) -> None:
    await send({"type": "http.response.start", "status": _TOO_LARGE.status or 500, "headers": _TOO_LARGE_HEADERS})
    await send({"type": "http.response.body", "body": _TOO_LARGE_BODY, "more_body": False})


def edge(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
            head += sum(len(name) + len(value) for name, value in scope["headers"])
            if head > MAX_HEADER_BYTES:
                await _refuse_large_head(send)
                return
        await app(scope, receive, send)

    return middleware


class _Held:
    """Stands in for the transport while uvicorn writes a response head: keeps it."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class _HeadFirst:
    """Stands in for the transport while uvicorn writes a body: the held head goes out with
    the first write, or before the connection closes if nothing is written (a HEAD request)."""

    __slots__ = ("_transport", "head")

    def __init__(self, transport: asyncio.Transport, head: bytes) -> None:
        self._transport = transport
        self.head: bytes | None = head

    def write(self, data: bytes) -> None:
        head, self.head = self.head, None
        self._transport.write(data if head is None else head + data)

    def close(self) -> None:
        if self.head is not None:
            self.write(b"")
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _OneWrite:
    """A cycle's ``send``: the head of a response with a ``content-length`` is held until its
    body, and both go out in one write (module docstring)."""

    __slots__ = ("_cycle", "_send", "_head")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._send = cycle.send
        self._head: bytes | None = None

    async def __call__(self, message: Any) -> None:
        cycle = self._cycle
        if self._head is not None:
            transport, stand_in = cycle.transport, _HeadFirst(cycle.transport, self._head)
            self._head = None
            cycle.transport = stand_in  # type: ignore[assignment]
            try:
                await self._send(message)
            finally:
                cycle.transport = transport
            if stand_in.head is not None and cycle.response_complete and not cycle.disconnected:
                transport.write(stand_in.head)  # complete without a write: a HEAD request
            return
        if (message["type"] == "http.response.start" and not cycle.response_started and not cycle.disconnected
                and any(name.lower() == b"content-length" for name, _ in message.get("headers", ()))):
            transport, held = cycle.transport, _Held()
            cycle.transport = held  # type: ignore[assignment]
            try:
                await self._send(message)
            finally:
                cycle.transport = transport
            self._head = held.data
            return
        await self._send(message)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on an unfinished request head, whose
    responses of known length leave in one write."""

    _in_head = False  # a request's first bytes arrived, its headers are not complete yet
    _head_bytes = 0
    _refused = False  # answered 431: what else arrives is dropped until the client closes

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and not isinstance(cycle.send, _OneWrite):
            # Read by the cycle's task when the app is called, which is after this returns.
            cycle.send = _OneWrite(cycle)  # type: ignore[method-assign]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_RAW_HEAD_BYTES:
                self._refuse()

    def _refuse(self) -> None:
        # Closing at once with the client's bytes unread would reset the connection, and the
        # client might never read the answer: end our side, drop the rest, close soon.
        self._in_head = False
        self._refused = True
        self.transport.write(_TOO_LARGE_RAW)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self.transport.close)
