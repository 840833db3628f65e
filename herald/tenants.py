"""Tenants as the rest of Herald sees them: their limits (SPEC §13), their keys' scopes (§12).

A tenant's limits are data (the admin API changes them at run time) with deployment-wide
defaults from the settings. Every component that enforces a limit asks a ``LimitsSource``
(the process's tenant directory, ``herald.directory``) instead of reading settings, so a
change made through ``/admin`` reaches it within seconds and without a restart.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from herald.constants import ISSUED_KEY_PREFIX
from herald.sealing import Sealer
from herald.settings import Settings
from herald.timefmt import rfc3339
from schemas.admin import TENANT_ID_PATTERN as TENANT_ID_PATTERN  # re-exported: the ids SPEC §12 allows

# SPEC §12: what a key may do. A key without the scope a route needs gets 403.
SCOPE_JOBS_READ = "jobs:read"
SCOPE_JOBS_WRITE = "jobs:write"
SCOPE_WEBHOOKS = "webhooks"
ALL_SCOPES: tuple[str, ...] = (SCOPE_JOBS_READ, SCOPE_JOBS_WRITE, SCOPE_WEBHOOKS)


@dataclass(frozen=True, slots=True)
class Limits:
    """One tenant's limits (SPEC §13). ``max_running`` 0 means no cap."""

    rate_limit: float
    max_running: int
    max_endpoints: int
    max_streams: int

    @classmethod
    def defaults(cls, settings: Settings) -> Limits:
        return cls(
            rate_limit=settings.rate_limit,
            max_running=settings.tenant_max_running,
            max_endpoints=settings.tenant_max_endpoints,
            max_streams=settings.max_held_per_tenant,
        )


class LimitsSource(Protocol):
    def limits(self, tenant: str) -> Limits:
        """The tenant's limits now (its own where set, else the deployment's defaults)."""
        ...


class DefaultLimits:
    """Every tenant at the deployment's defaults: for a process without a tenant directory."""

    def __init__(self, settings: Settings) -> None:
        self._limits = Limits.defaults(settings)

    def limits(self, tenant: str) -> Limits:
        return self._limits


# ----- tenants and keys as the store keeps them (SPEC §12) ------------------------------------

KEY_PREFIX = ISSUED_KEY_PREFIX
SOURCE_API = "api"
SOURCE_ENV = "env"
LIMIT_NAMES: tuple[str, ...] = ("rate_limit", "max_running", "max_endpoints", "max_streams")

# The audit log's actions (SPEC §12).
TENANT_CREATED = "tenant.created"
TENANT_UPDATED = "tenant.updated"
TENANT_DISABLED = "tenant.disabled"
KEY_CREATED = "key.created"
KEY_REVOKED = "key.revoked"


@dataclass(frozen=True, slots=True)
class TenantRow:
    """A tenant as stored: ``limits`` holds only the limits set for it (the rest are defaults)."""

    id: str
    created_at: float
    disabled: bool
    limits: Mapping[str, float]
    source: str = SOURCE_API

    def effective_limits(self, defaults: Limits) -> Limits:
        return Limits(
            rate_limit=float(self.limits.get("rate_limit", defaults.rate_limit)),
            max_running=int(self.limits.get("max_running", defaults.max_running)),
            max_endpoints=int(self.limits.get("max_endpoints", defaults.max_endpoints)),
            max_streams=int(self.limits.get("max_streams", defaults.max_streams)),
        )


def merged_limits(current: Mapping[str, float], changes: Mapping[str, float | None] | None) -> dict[str, float]:
    """A tenant's own limits after a change: a value sets one, None returns it to the default
    (drops it); names that are not limits are ignored."""
    merged = dict(current)
    for name, value in (changes or {}).items():
        if name not in LIMIT_NAMES:
            continue
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged


@dataclass(frozen=True, slots=True)
class KeyRow:
    """An API key as stored: its hash only, never the key."""

    id: str
    tenant: str
    name: str
    scopes: tuple[str, ...]
    digest: bytes = field(repr=False)
    created_at: float
    expires_at: float | None = None
    last_used_at: float | None = None
    source: str = SOURCE_API

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def revoked_detail(self) -> dict[str, object]:
        """What the audit keeps of a revoked key: its name and its last recorded use, which
        its listing no longer shows once it is revoked (README, "When a key leaks")."""
        return {"name": self.name, "last_used_at": rfc3339(self.last_used_at)}


@dataclass(frozen=True, slots=True)
class AuditRow:
    id: str
    at: float
    action: str
    tenant: str | None
    key_id: str | None
    detail: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class DirectorySnapshot:
    """Every tenant row and live (unrevoked) key, at one ``version`` of the directory."""

    version: int
    tenants: Sequence[TenantRow]
    keys: Sequence[KeyRow]


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A key just made: ``plaintext`` is shown once, the store keeps ``digest``."""

    id: str
    plaintext: str = field(repr=False)
    digest: bytes = field(repr=False)


def key_digest(secret: str) -> bytes:
    """What the store keeps of a key's secret part. A key carries 256 random bits, so a
    plain SHA-256 is enough: there is nothing to guess that a slow hash would protect."""
    return hashlib.sha256(secret.encode()).digest()


def issue_key() -> IssuedKey:
    """``hk_<id>_<secret>``: the id (64 bits, hex) finds the row, the secret (256 bits) is
    compared by hash in constant time, so the check costs the same for every key."""
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    return IssuedKey(id=key_id, plaintext=f"{KEY_PREFIX}{key_id}_{secret}", digest=key_digest(secret))


def split_key(token: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a token shaped like an issued key, else None."""
    if not token.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = token[len(KEY_PREFIX):].partition("_")
    if not sep or len(key_id) != 16 or not secret or not key_id.isascii() or not secret.isascii():
        return None
    return key_id, secret


def env_key_id(tenant: str, key: str, sealer: Sealer) -> str:
    """A stable id for a key from ``HERALD_API_KEYS``: the same in every process, and
    revealing nothing of the key. It goes out in portal links and sessions, and an operator's
    key may be a guessable word: so a keyed hash (``Sealer.tag``), never a plain one that
    anyone could check guesses against."""
    return "env-" + sealer.tag(f"{tenant}:{key}")


def env_keys(settings: Settings, sealer: Sealer) -> list[KeyRow]:
    """``HERALD_API_KEYS`` as key rows: every scope, no expiry, ``source: env``."""
    return [
        KeyRow(id=env_key_id(tenant, key, sealer), tenant=tenant, name="HERALD_API_KEYS", scopes=ALL_SCOPES,
               digest=key_digest(key), created_at=0.0, source=SOURCE_ENV)
        for key, tenant in settings.api_keys.items()
    ]
