"""The edge of the HTTP server, around the whole app: request-head limits and header case.

* A request head over ``MAX_HEADER_BYTES`` is refused with ``431`` before the app sees it
  (h11 enforces its own limit only on heads that arrive in pieces).
* Response header names go out in their canonical case (``Location``, ``ETag``). Names
  are case-insensitive, but ASGI carries them lower-cased and some clients (a plain
  ``dict(response.headers)`` in a script) look them up as the RFCs spell them.
"""

from __future__ import annotations

from functools import lru_cache

import msgspec
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from schemas import Problem

MAX_HEADER_BYTES = 16 * 1024
_SPECIAL = {b"etag": b"ETag", b"www-authenticate": b"WWW-Authenticate", b"x-request-id": b"X-Request-ID"}
_TOO_LARGE = msgspec.json.encode(Problem(
    type="/problems/headers-too-large", title="Request header fields too large", status=431,
    detail=f"the request's headers exceed {MAX_HEADER_BYTES} bytes",
))


@lru_cache(maxsize=256)
def canonical(name: bytes) -> bytes:
    return _SPECIAL.get(name.lower()) or b"-".join(part.capitalize() for part in name.split(b"-"))


async def _refuse_large_head(send: Send) -> None:
    await send({"type": "http.response.start", "status": 431, "headers": [
        (b"Content-Type", b"application/problem+json"), (b"Content-Length", str(len(_TOO_LARGE)).encode()),
    ]})
    await send({"type": "http.response.body", "body": _TOO_LARGE, "more_body": False})


def edge(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
        head += sum(len(name) + len(value) for name, value in scope["headers"])
        if head > MAX_HEADER_BYTES:
            await _refuse_large_head(send)
            return

        async def send_canonical(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [(canonical(name), value) for name, value in message.get("headers", ())]
            await send(message)

        await app(scope, receive, send_canonical)

    return middleware
