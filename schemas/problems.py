"""RFC 9457 problem details."""

from __future__ import annotations

import msgspec


class FieldError(msgspec.Struct, kw_only=True):
    field: str
    message: str


class Problem(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    title: str
    status: int | None = None
    detail: str | None = None
    errors: list[FieldError] | None = None
