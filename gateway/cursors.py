"""Opaque page cursors: one encoding for every list (jobs, endpoints, deliveries).

A cursor is base64url of a position: ``<created_at>|<id>`` for lists ordered by creation,
or a sequence number. Decoding checks that the position is one Herald could have given
out (a UUID, a finite time, a number a 64-bit column holds), so a forged cursor is a 400,
never a store error.
"""

from __future__ import annotations

import base64
import binascii
import math

from gateway.ids import is_uuid
from gateway.problems import InvalidCursor

MAX_SEQ = 2**63 - 1  # the largest value a BIGINT (and SQLite's INTEGER) holds


def _encode(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode()).decode().rstrip("=")


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
