"""The admin API (SPEC §12): tenants, their keys and limits, and the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec

from schemas.base import Base
from schemas.problems import FieldError

Scope = Literal["jobs:read", "jobs:write", "webhooks"]
# (?!\n): Python's '$' also matches before a final newline, and msgspec checks patterns with
# Python's re; a tenant id ends up in NATS subjects, where a newline ends a protocol line.
# (In the OpenAPI document's ECMAScript reading, '$' is the end and the look-ahead a no-op.)
TENANT_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$(?!\n)"
TenantId = Annotated[str, msgspec.Meta(pattern=TENANT_ID_PATTERN,
                                       description="lower-case letters, digits, '_' and '-', 1..63 characters")]
Rate = Annotated[float, msgspec.Meta(ge=0, le=1_000_000)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1_000_000_000)]


class _Body(Base, kw_only=True):
    def cross_field_errors(self) -> list[FieldError]:
        return []


class LimitsPatch(_Body, kw_only=True, omit_defaults=True):
    """A tenant's own limits: a value sets one, ``null`` returns it to the deployment's default,
    an absent field leaves it as it is."""

    rate_limit: Rate | None | msgspec.UnsetType = msgspec.UNSET
    max_running: Count | None | msgspec.UnsetType = msgspec.UNSET
    max_endpoints: Count | None | msgspec.UnsetType = msgspec.UNSET
    max_streams: Count | None | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> dict[str, float | None]:
        # `+ 0.0`: a rate of -0.0 passes `ge=0` and would be kept, shown and audited as "-0.0".
        return {name: value + 0.0 if isinstance(value, float) else value for name in self.__struct_fields__
                if (value := getattr(self, name)) is not msgspec.UNSET}


class TenantCreate(_Body, kw_only=True):
    """``POST /admin/tenants``."""

    id: TenantId
    limits: LimitsPatch | None = None


class TenantUpdate(_Body, kw_only=True):
    """``PATCH /admin/tenants/{id}``: only the fields present change."""

    limits: LimitsPatch | msgspec.UnsetType = msgspec.UNSET
    disabled: bool | msgspec.UnsetType = msgspec.UNSET


class TenantLimits(msgspec.Struct, kw_only=True):
    rate_limit: float
    max_running: int
    max_endpoints: int
    max_streams: int


class Tenant(msgspec.Struct, kw_only=True):
    id: str
    created_at: str | None  # null for a tenant of HERALD_API_KEYS never changed over the API
    disabled: bool
    limits: TenantLimits
    source: Literal["api", "env"]


class TenantList(msgspec.Struct, kw_only=True):
    items: list[Tenant]
    next_cursor: str | None


# Not blank: leading spaces, then one character that is neither a space nor a control, then any
# but controls. No look-ahead: a generator of examples (schemathesis) has to filter for one,
# and the two classes before the first non-space cannot overlap, so matching stays linear.
_CONTROLS = "\\x00-\\x1f\\x7f-\\x9f\\u2028\\u2029"
NAME_PATTERN = f"^[^\\S{_CONTROLS}]*[^\\s{_CONTROLS}][^{_CONTROLS}]*$(?!\\n)"


class KeyCreate(_Body, kw_only=True):
    """``POST /admin/tenants/{id}/keys``."""

    # No control characters (C0, C1, and the line and paragraph separators): a name is shown in
    # tables and logs, and PostgreSQL text holds no NUL. Not only spaces: a name is what tells
    # the keys apart, and a blank one tells nothing.
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=100,
                                      pattern=NAME_PATTERN)]
    scopes: Annotated[list[Scope], msgspec.Meta(min_length=1, max_length=3)] | None = None  # None: every scope
    expires_at: Annotated[datetime, msgspec.Meta(tz=True, description="RFC 3339 time with an offset")] | None = None


class ApiKey(msgspec.Struct, kw_only=True):
    id: str
    tenant: str
    name: str
    scopes: list[str]
    created_at: str | None
    expires_at: str | None
    last_used_at: str | None  # to the minute: written at most once a minute
    source: Literal["api", "env"] = "api"


class CreatedApiKey(ApiKey, kw_only=True):
    key: str  # the key itself: in this answer only, never again


class ApiKeyList(msgspec.Struct, kw_only=True):
    items: list[ApiKey]


class AuditEntry(msgspec.Struct, kw_only=True):
    id: str
    at: str
    action: str
    tenant: str | None
    key_id: str | None
    detail: dict[str, Any]


class AuditList(msgspec.Struct, kw_only=True):
    items: list[AuditEntry]
    next_cursor: str | None
