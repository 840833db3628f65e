"""Opaque page cursors: one encoding for every list (jobs, endpoints, deliveries).

A cursor is base64url of a position: ``<created_at>|<id>`` for lists ordered by creation,
a name, or a sequence number. Decoding checks that the position is one Herald could have
given out (a UUID, a finite time, a number a 64-bit column holds), so a forged cursor is a
400, never a store error.

A sequence number that every tenant's rows draw from (a delivery's ``seq``) is never shown
as it is: the gaps between one tenant's cursors would count the other tenants' traffic. Such
a cursor is sealed (``seal_seq``: AES-GCM of the store's sealer, fixed width, a random nonce,
bound to the list it pages), so it shows nothing but its length, and one that was altered,
made for another list or sealed under a key no longer held opens to a 400.
"""

from __future__ import annotations

import base64
import binascii
import math

from gateway.ids import is_uuid
from gateway.problems import InvalidCursor
from herald.sealing import Sealer, SealError

MAX_SEQ = 2**63 - 1  # the largest value a BIGINT (and SQLite's INTEGER) holds
_SEQ_BYTES = 8  # every sealed seq is as long as any other: its length tells no magnitude
# A sealed cursor's text is 67 characters (magic, key fingerprint, nonce, 8 bytes, tag);
# anything far longer is refused before it is decoded.
_MAX_SEALED_LENGTH = 128


def _encode(value: str) -> str:
    return _encode_bytes(value.encode())


def _encode_bytes(value: bytes) -> str:
    return base64.urlsafe_b64encode(value).decode().rstrip("=")


def _decode(raw: str) -> str:
    try:
        return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidCursor() from exc


def encode_position(created_at: float, row_id: str) -> str:
    return _encode(f"{created_at!r}|{row_id}")


def decode_position(raw: str) -> tuple[float, str]:
    created, _, row_id = _decode(raw).partition("|")
    try:
        at = float(created)
    except ValueError as exc:
        raise InvalidCursor() from exc
    if not math.isfinite(at) or not is_uuid(row_id):
        raise InvalidCursor()
    return at, row_id


def encode_name(name: str) -> str:
    return _encode(name)


def decode_name(raw: str, max_length: int = 64) -> str:
    """A position by name (tenants are listed by id): printable ASCII within a length."""
    name = _decode(raw)
    if not name or len(name) > max_length or not name.isascii() or not name.isprintable():
        raise InvalidCursor()
    return name


def encode_seq(seq: int) -> str:
    return _encode(str(seq))


def decode_seq(raw: str) -> int:
    return parse_seq(_decode(raw))


def parse_seq(text: str) -> int:
    """A plain sequence number (event ids, ``after=``): digits, within a 64-bit column."""
    if not text.isascii() or not text.isdigit() or len(text) > 19 or int(text) > MAX_SEQ:
        raise InvalidCursor()
    return int(text)


def _scope_aad(scope: str) -> bytes:
    # Apart from every secret's associated data (``herald.sealing``: ``webhook_keys|…``,
    # ``herald_secrets|…``), so a cursor never opens as a secret, nor a secret as a cursor.
    return b"cursor|" + scope.encode()


def seal_seq(sealer: Sealer, seq: int, scope: str) -> str:
    """A cursor for ``seq`` that shows nothing of it, opened only by ``open_seq`` with the same
    ``scope`` (the list it pages: e.g. ``webhook_deliveries|<endpoint id>``)."""
    return _encode_bytes(sealer.seal(seq.to_bytes(_SEQ_BYTES, "big"), _scope_aad(scope)))


def open_seq(sealer: Sealer, raw: str, scope: str) -> int:
    """The seq ``seal_seq`` sealed for ``scope``; ``InvalidCursor`` for anything else."""
    if len(raw) > _MAX_SEALED_LENGTH:
        raise InvalidCursor()
    try:
        blob = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        plain = sealer.open(blob, _scope_aad(scope))
    except (ValueError, binascii.Error, SealError) as exc:
        raise InvalidCursor() from exc
    seq = int.from_bytes(plain, "big")
    if len(plain) != _SEQ_BYTES or seq > MAX_SEQ:
        raise InvalidCursor()
    return seq
