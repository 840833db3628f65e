"""Tenancy: bearer keys (compared in constant time), portal sessions and signed URLs.

A *portal session* (SPEC §7) is a bearer token ``hps_<exp>.<tenant, base64url>.<sig>``
that ``POST /portal/session`` hands out for a valid portal link: an HMAC under the URL
signing keys, scoped to one tenant and to the ``/webhooks`` routes. The webhook routes
take it (``require_webhook_tenant``); every other route refuses it with ``403
/problems/portal-scope`` (``require_tenant``, ``bearer_tenant``), so a portal link never
opens a tenant's jobs, and its tenant is inside the signature, so never another tenant's
anything.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from litestar import Request

from gateway.problems import PortalScope, Unauthorized
from herald.settings import Settings
from herald.signing import UrlSigner

PORTAL_TOKEN_PREFIX = "hps_"
PORTAL_LINK_PURPOSE = "portal"  # the signed /portal URL: valid HERALD_SIGNED_URL_TTL_S to open
PORTAL_SESSION_PURPOSE = "portal-session"
PORTAL_SESSION_PATH = "/webhooks"
PORTAL_SESSION_S = 8 * 3600  # an opened portal works this long (a working day), then needs a fresh link
MAX_TENANT_LENGTH = 64


def _tenant_for_key(settings: Settings, presented: str) -> str | None:
    found: str | None = None
    candidate = presented.encode()
    # Compare against every key so timing does not reveal how many matched or where.
    for key, tenant in settings.api_keys.items():
        if hmac.compare_digest(key.encode(), candidate):
            found = tenant
    return found


def _bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header or len(header) > 1024:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def bearer_tenant(request: Request, settings: Settings) -> str | None:
    """The tenant of the request's API key; None without a valid one. A portal session
    token is refused outright (403): it is valid only on the webhook routes."""
    token = _bearer_token(request)
    if token is None:
        return None
    if token.startswith(PORTAL_TOKEN_PREFIX):
        raise PortalScope()
    return _tenant_for_key(settings, token)


def require_tenant(request: Request, settings: Settings) -> str:
    tenant = bearer_tenant(request, settings)
    if tenant is None:
        raise Unauthorized()
    return tenant


# ----- portal sessions ---------------------------------------------------------------------


def portal_token(signer: UrlSigner, tenant: str) -> str:
    exp, sig = signer.seal(PORTAL_SESSION_PATH, PORTAL_SESSION_PURPOSE, extra=tenant, ttl_s=PORTAL_SESSION_S)
    name = base64.urlsafe_b64encode(tenant.encode()).decode().rstrip("=")
    return f"{PORTAL_TOKEN_PREFIX}{exp}.{name}.{sig}"


def portal_token_tenant(signer: UrlSigner, token: str) -> str | None:
    """The tenant a portal session token was made for, if it is genuine and not expired."""
    exp, _, rest = token.removeprefix(PORTAL_TOKEN_PREFIX).partition(".")
    name, _, sig = rest.partition(".")
    try:
        tenant = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None
    if not tenant or len(tenant) > MAX_TENANT_LENGTH:
        return None
    if not signer.verify(PORTAL_SESSION_PATH, PORTAL_SESSION_PURPOSE, exp, sig, extra=tenant):
        return None
    return tenant


def require_webhook_tenant(request: Request, settings: Settings, signer: UrlSigner) -> str:
    """The tenant of an API key or of a portal session: the webhook routes take both."""
    token = _bearer_token(request)
    if token is not None and token.startswith(PORTAL_TOKEN_PREFIX):
        tenant = portal_token_tenant(signer, token)
        if tenant is None:
            raise Unauthorized("this portal session has expired or is not valid: open a fresh portal link")
        return tenant
    tenant = _tenant_for_key(settings, token) if token is not None else None
    if tenant is None:
        raise Unauthorized()
    return tenant
