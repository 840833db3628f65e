"""Reading a JSON request body, the same way on every route that takes one.

415 for a missing or non-JSON content type, or a body sent with a content coding (gzip…: the
gateway reads identity only, and says so with ``Accept-Encoding``, RFC 9110 §15.5.16), 400
``/problems/malformed-json`` for bytes
that are not JSON, 400 ``/problems/invalid-request`` naming every bad field, and the
SSRF guard's verdict on a URL turned into such a field error.

A body that stops arriving (a ``Content-Length`` larger than what is sent, then silence) is
answered 408 once ``BODY_IDLE_S`` pass without a piece of it, and the connection closed: the
HTTP server sets no such bound, so the request was never answered and held its connection
and its task for as long as the client kept the socket open. As with nginx's
``client_body_timeout``, the bound is on each pause, not on the whole body, so a slow link
that keeps sending is never cut.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from litestar import Request

from gateway.problems import InvalidRequest, MalformedJson, RequestTimeout, UnsupportedMediaType
from herald.resolver import Resolver
from herald.settings import Settings
from herald.ssrf import UnsafeUrl, check_url_resolves_public
from schemas import FieldError
from schemas.validation import InvalidBody, MalformedBody, decode_json, validate_params

T = TypeVar("T")

BODY_IDLE_S = 30.0  # the longest pause between two pieces of a body (REQUEST_TIMEOUT's note says it too)


def check_json_content_type(request: Request) -> None:
    # Two Content-Type headers say two things about one body (the framework reads the first).
    sent = request.headers.getall("content-type", [])
    media_type = sent[0].split(";")[0].strip().lower() if len(sent) == 1 else ""
    if media_type != "application/json" and not (media_type.startswith("application/") and media_type.endswith("+json")):
        raise UnsupportedMediaType(
            "send the body as JSON with one Content-Type: application/json",
            headers={"Accept-Post": "application/json"},
        )


def check_identity_coding(request: Request) -> None:
    # A gzipped body read as it came would be answered "malformed JSON", which it is not.
    codings = [coding.strip().lower() for line in request.headers.getall("content-encoding", [])
               for coding in line.split(",")]
    if any(coding not in ("", "identity") for coding in codings):
        raise UnsupportedMediaType(
            "send the body without a Content-Encoding: this server reads it as it comes (identity)",
            headers={"Accept-Encoding": "identity"},
        )


async def read_body(request: Request, body_type: type[T]) -> tuple[T, Any]:
    """The validated body and the JSON document it was read from (for fingerprints)."""
    check_json_content_type(request)
    check_identity_coding(request)
    raw = await _body_bytes(request)
    try:
        document = decode_json(raw)
        return validate_params(body_type, document), document  # type: ignore[type-var,unused-ignore]
    except MalformedBody as exc:
        raise MalformedJson(f"the body is not valid JSON: {exc}") from exc
    except InvalidBody as exc:
        raise InvalidRequest(exc.errors) from exc


async def _body_bytes(request: Request) -> bytes:
    """The whole body, each piece of it due within ``BODY_IDLE_S`` of the one before (over
    1 MiB: 413, from the framework's stream, as from ``request.body()``)."""
    pieces: list[bytes] = []
    stream = request.stream()
    try:
        while True:
            try:
                async with asyncio.timeout(BODY_IDLE_S):
                    piece = await anext(stream, None)
            except TimeoutError:
                raise RequestTimeout(f"the body stopped arriving: nothing of it came for {BODY_IDLE_S:g} s",
                                     headers={"Connection": "close"}) from None
            if piece is None:
                return b"".join(pieces)
            pieces.append(piece)
    finally:
        await stream.aclose()


async def url_errors(settings: Settings, resolver: Resolver, field: str, url: str | None) -> list[FieldError]:
    """The SSRF guard (https to a public address, resolved now) as field errors."""
    if url is None:
        return []
    if any(ord(char) <= 0x20 or ord(char) == 0x7F for char in url):
        # A URL carries spaces and control characters only percent-encoded (RFC 3986), and
        # PostgreSQL text holds no NUL: refused here, named, rather than failing later.
        return [FieldError(field=field, message="must not contain spaces or control characters (percent-encode them)")]
    try:
        await check_url_resolves_public(url, allow_private=settings.webhook_allow_private, resolver=resolver)
    except UnsafeUrl as exc:
        return [FieldError(field=field, message=str(exc))]
    return []
