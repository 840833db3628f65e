"""Reading a JSON request body, the same way on every route that takes one.

415 for a missing or non-JSON content type, 400 ``/problems/malformed-json`` for bytes
that are not JSON, 400 ``/problems/invalid-request`` naming every bad field, and the
SSRF guard's verdict on a URL turned into such a field error.
"""

from __future__ import annotations

from typing import Any, TypeVar

from litestar import Request

from gateway.problems import InvalidRequest, MalformedJson, UnsupportedMediaType
from herald.settings import Settings
from herald.ssrf import UnsafeUrl, check_url_resolves_public
from schemas import FieldError
from schemas.validation import InvalidBody, MalformedBody, decode_json, validate_params

T = TypeVar("T")


def check_json_content_type(request: Request) -> None:
    # Two Content-Type headers say two things about one body (the framework reads the first).
    sent = request.headers.getall("content-type", [])
    media_type = sent[0].split(";")[0].strip().lower() if len(sent) == 1 else ""
    if media_type != "application/json" and not (media_type.startswith("application/") and media_type.endswith("+json")):
        raise UnsupportedMediaType(
            "send the body as JSON with one Content-Type: application/json",
            headers={"Accept-Post": "application/json"},
        )


async def read_body(request: Request, body_type: type[T]) -> tuple[T, Any]:
    """The validated body and the JSON document it was read from (for fingerprints)."""
    check_json_content_type(request)
    try:
        document = decode_json(await request.body())
        return validate_params(body_type, document), document  # type: ignore[type-var,unused-ignore]
    except MalformedBody as exc:
        raise MalformedJson(f"the body is not valid JSON: {exc}") from exc
    except InvalidBody as exc:
        raise InvalidRequest(exc.errors) from exc


async def url_errors(settings: Settings, field: str, url: str | None) -> list[FieldError]:
    """The SSRF guard (https to a public address, resolved now) as field errors."""
    if url is None:
        return []
    if any(ord(char) <= 0x20 or ord(char) == 0x7F for char in url):
        # A URL carries spaces and control characters only percent-encoded (RFC 3986), and
        # PostgreSQL text holds no NUL: refused here, named, rather than failing later.
        return [FieldError(field=field, message="must not contain spaces or control characters (percent-encode them)")]
    try:
        await check_url_resolves_public(url, allow_private=settings.webhook_allow_private)
    except UnsafeUrl as exc:
        return [FieldError(field=field, message=str(exc))]
    return []
