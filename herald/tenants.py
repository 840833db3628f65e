"""Tenants as the rest of Herald sees them: their limits (SPEC §13), their keys' scopes (§12).

A tenant's limits are data (the admin API changes them at run time) with deployment-wide
defaults from the settings. Every component that enforces a limit asks a ``LimitsSource``
(the process's tenant directory, ``herald.directory``) instead of reading settings, so a
change made through ``/admin`` reaches it within seconds and without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from herald.settings import Settings

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
