"""Tenancy: bearer keys (compared in constant time) and signed URLs."""

from __future__ import annotations

import hmac

from litestar import Request

from gateway.problems import Unauthorized
from herald.settings import Settings


def _tenant_for_key(settings: Settings, presented: str) -> str | None:
    found: str | None = None
    candidate = presented.encode()
    # Compare against every key so timing does not reveal how many matched or where.
    for key, tenant in settings.api_keys.items():
        if hmac.compare_digest(key.encode(), candidate):
            found = tenant
    return found


def bearer_tenant(request: Request, settings: Settings) -> str | None:
    header = request.headers.get("authorization")
    if not header or len(header) > 1024:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return _tenant_for_key(settings, token.strip())


def require_tenant(request: Request, settings: Settings) -> str:
    tenant = bearer_tenant(request, settings)
    if tenant is None:
        raise Unauthorized()
    return tenant
