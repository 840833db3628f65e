"""Verifying Herald's webhook deliveries on the receiving side (Standard Webhooks).

A delivery carries ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature``; the
signed content is ``"{id}.{timestamp}.{body}"``. ``webhook-signature`` holds one or more
space-separated ``version,base64`` pairs (several while a secret is being rotated):

* ``v1``: HMAC-SHA256 with the endpoint's ``whsec_<base64 key>`` secret;
* ``v1a``: Ed25519, checked with the endpoint's ``whpk_<base64 32-byte public key>``
  (needs ``cryptography``: ``pip install 'herald-client[ed25519]'``).

Verify against the raw body bytes exactly as received, before parsing them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping

import msgspec

from herald_client.errors import WebhookVerificationError
from herald_client.models import WebhookEvent, decode_webhook

DEFAULT_TOLERANCE_S = 300  # Standard Webhooks: reject timestamps more than 5 minutes off
HMAC_PREFIX = "whsec_"
ED25519_PREFIX = "whpk_"


def _header(headers: Mapping[str, str], name: str) -> str:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    raise WebhookVerificationError(f"missing {name} header")


def _b64(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WebhookVerificationError(f"{what} is not valid base64") from exc


def _signatures(header: str, version: str) -> list[str]:
    found = []
    for item in header.split():
        name, comma, value = item.partition(",")
        if comma and name == version:
            found.append(value)
    return found


def _hmac_ok(secret: str, content: bytes, header: str) -> bool:
    key = base64.b64decode(secret.removeprefix(HMAC_PREFIX))
    expected = base64.b64encode(hmac.new(key, content, hashlib.sha256).digest())
    return any(hmac.compare_digest(expected, candidate.encode()) for candidate in _signatures(header, "v1"))


def _ed25519_ok(public_key: str, content: bytes, header: str) -> bool:
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("Ed25519 webhooks need cryptography: pip install 'herald-client[ed25519]'") from exc
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key.removeprefix(ED25519_PREFIX)))
    except ValueError as exc:
        raise ValueError("not an Ed25519 public key (expected whpk_<base64 of 32 bytes>)") from exc
    for candidate in _signatures(header, "v1a"):
        try:
            key.verify(_b64(candidate, "a v1a signature"), content)
            return True
        except (InvalidSignature, WebhookVerificationError):
            continue
    return False


def verify_webhook(
    headers: Mapping[str, str],
    body: bytes | str,
    secret: str | Iterable[str],
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> WebhookEvent:
    """Check a delivery's signature and timestamp; return its payload, typed.

    ``secret``: the endpoint's ``whsec_…`` secret or ``whpk_…`` public key, or several
    (old and new during a rotation; any one verifying is enough). Raises
    ``WebhookVerificationError`` when a header is missing, the timestamp is further than
    ``tolerance_s`` from ``now`` (replays), or no signature matches. Deliveries are
    at-least-once: de-duplicate by ``headers["webhook-id"]``.
    """
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets:
        raise ValueError("no secret given")
    for item in secrets:
        if not item.startswith((HMAC_PREFIX, ED25519_PREFIX)):
            raise ValueError("a secret must be 'whsec_…' (HMAC) or 'whpk_…' (Ed25519 public key)")
    raw = body.encode() if isinstance(body, str) else bytes(body)
    message_id = _header(headers, "webhook-id")
    timestamp = _header(headers, "webhook-timestamp")
    signature = _header(headers, "webhook-signature")
    try:
        sent_at = int(timestamp)
    except ValueError as exc:
        raise WebhookVerificationError("webhook-timestamp is not Unix seconds") from exc
    current = time.time() if now is None else now
    if abs(current - sent_at) > tolerance_s:
        raise WebhookVerificationError(f"webhook-timestamp is {current - sent_at:+.0f} s off (tolerance {tolerance_s:g} s)")
    content = f"{message_id}.{sent_at}.".encode() + raw
    for item in secrets:
        check = _hmac_ok if item.startswith(HMAC_PREFIX) else _ed25519_ok
        if check(item, content, signature):
            break
    else:
        raise WebhookVerificationError("no signature matches")
    try:
        return decode_webhook(raw)
    except msgspec.DecodeError as exc:
        raise WebhookVerificationError(f"signed, but not a Herald event: {exc}") from exc
