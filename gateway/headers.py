"""Response header names in their canonical case (``Location``, ``Retry-After``, ``ETag``).

Header names are case-insensitive, but ASGI carries them lower-cased and some clients
(a plain ``dict(response.headers)`` in a script) look them up as the RFCs spell them.
"""

from __future__ import annotations

from functools import lru_cache

from litestar.types import ASGIApp, Message, Receive, Scope, Send

_SPECIAL = {b"etag": b"ETag", b"www-authenticate": b"WWW-Authenticate", b"x-request-id": b"X-Request-ID"}


@lru_cache(maxsize=256)
def canonical(name: bytes) -> bytes:
    return _SPECIAL.get(name.lower()) or b"-".join(part.capitalize() for part in name.split(b"-"))


def canonical_header_case(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_canonical(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [(canonical(name), value) for name, value in message.get("headers", ())]
            await send(message)

        await app(scope, receive, send_canonical)

    return middleware
