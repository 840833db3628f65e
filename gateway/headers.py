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

from gateway.problems import PROBLEM_MEDIA_TYPE
from schemas.problems import HEADERS_TOO_LARGE

MAX_HEADER_BYTES = 16 * 1024
_SPECIAL = {b"etag": b"ETag", b"www-authenticate": b"WWW-Authenticate", b"x-request-id": b"X-Request-ID"}
_TOO_LARGE = HEADERS_TOO_LARGE.problem(f"the request's headers exceed {MAX_HEADER_BYTES} bytes")
_TOO_LARGE_BODY = msgspec.json.encode(_TOO_LARGE)


@lru_cache(maxsize=256)
def canonical(name: bytes) -> bytes:
    return _SPECIAL.get(name.lower()) or b"-".join(part.capitalize() for part in name.split(b"-"))


async def _refuse_large_head(send: Send) -> None:
    await send({"type": "http.response.start", "status": _TOO_LARGE.status or 500, "headers": [
        (b"Content-Type", PROBLEM_MEDIA_TYPE.encode()), (b"Content-Length", str(len(_TOO_LARGE_BODY)).encode()),
    ]})
    await send({"type": "http.response.body", "body": _TOO_LARGE_BODY, "more_body": False})


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
