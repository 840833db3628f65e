"""Who is calling: API keys with scopes, portal sessions, the operator's admin key (SPEC §2, §12).

Keys are checked against the process's tenant directory (``herald.directory``), which is
in memory: authenticating costs no store read. A route names the scope it needs
(``herald.tenants``); a valid key without it gets ``403 /problems/insufficient-scope``.

A *portal session* (SPEC §7) is a bearer token ``hps_<exp>.<tenant, base64url>.<key id>.<sig>``
that ``POST /portal/session`` hands out for a valid portal link: an HMAC under the URL
signing keys, scoped to one tenant, bound to the key that made the link (revoking that
key, or disabling the tenant, ends it) and to the ``/webhooks`` routes. The webhook
routes take it (``require_webhook_tenant``); every other route refuses it with ``403
/problems/portal-scope``, so a portal link never opens a tenant's jobs, and its tenant is
inside the signature, so never another tenant's anything.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import NoReturn

from litestar import Request

from gateway.problems import AdminOnly, InsufficientScope, PortalScope, Unauthorized
from gateway.services import Services
from gateway.sse import STREAM_OWNER
from herald.constants import PORTAL_TOKEN_PREFIX
from herald.directory import Principal, StreamOwner
from herald.jobs import StoreUnavailable
from herald.signing import UrlSigner
from herald.tenants import KEY_PREFIX, SCOPE_WEBHOOKS

PORTAL_LINK_PURPOSE = "portal"  # the signed /portal URL: valid HERALD_SIGNED_URL_TTL_S to open
PORTAL_SESSION_PURPOSE = "portal-session"
PORTAL_SESSION_PATH = "/webhooks"
PORTAL_SESSION_S = 8 * 3600  # an opened portal works this long (a working day), then needs a fresh link
MAX_TENANT_LENGTH = 64
MAX_KEY_ID_LENGTH = 64
_NO_LONGER_HOLDS = "this key was revoked or has expired, or its tenant was disabled"


def _bearer_token(request: Request) -> str | None:
    sent = request.headers.getall("authorization", [])
    if len(sent) > 1:  # two credentials: which one speaks for the request cannot be told
        raise Unauthorized("send one Authorization header, not several")
    header = sent[0] if sent else None
    if not header or len(header) > 1024:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _principal(token: str, svc: Services) -> Principal | None:
    principal = svc.directory.authenticate(token)
    if principal is None and token.startswith(KEY_PREFIX) and not svc.directory.loaded:
        # The store's keys are not loaded yet (PostgreSQL still connecting): the client can
        # outwait this, so 503 rather than a 401 that says the key is wrong.
        raise StoreUnavailable("the tenant directory is not loaded yet")
    return principal


def note_stream_owner(request: Request, svc: Services, tenant: str, key_id: str | None = None) -> None:
    """Who this request is for, so that a stream it opens ends when that no longer holds
    (``gateway.sse``): the key that authenticated it, or only the tenant of a signed link.

    A signed link (no key) of a disabled tenant is refused here, with the 401 its keys get
    (SPEC §12), before anything is read or counted for it: a valid signature names a tenant,
    it does not outrank the tenant being disabled."""
    if key_id is None and svc.directory.disabled(tenant):
        raise Unauthorized("this signed link's tenant is disabled")
    request.state[STREAM_OWNER] = StreamOwner(svc.directory, tenant, key_id)


@asynccontextmanager
async def held_for_owner(request: Request) -> AsyncIterator[None]:
    """Hold a long poll (``GET /jobs/{id}?wait=``, a held feed poll) only while whoever asked
    may (SPEC §12) and is still there.

    * The tenant directory ends it as it ends a held stream (``gateway.sse``), once the
      request's key is revoked or expires, or its tenant is disabled: the poll is answered the
      401 any request with that key now gets, not left to run out its wait.
    * A client that closes its connection ends it too, as a stream's disconnect does: the
      block is left early, as if its wait had run out, and what the route answers next goes
      nowhere. A poll nobody waits for held its tenant's ``max_streams`` slot (and the
      ``herald_long_polls`` gauge) for the rest of its ``wait``, up to 60 s, so a client whose
      own timeout is shorter than its ``wait`` filled its tenant's slots with polls it had
      given up on, and was answered 429."""
    owner: StreamOwner | None = request.state.get(STREAM_OWNER)
    if owner is not None and not owner.directory.stream_allowed(owner.tenant, owner.key_id):
        raise Unauthorized(_NO_LONGER_HOLDS)  # revoked between the request's authentication and now
    task = asyncio.current_task()
    assert task is not None
    holding = True
    ended_by: str | None = None

    def end(reason: str) -> None:
        nonlocal ended_by
        if holding and ended_by is None:  # once, and never after the block is done
            ended_by = reason
            task.cancel()

    held = owner.directory.hold_stream(owner, lambda: end("revoked")) if owner is not None else None
    listener = asyncio.ensure_future(_until_disconnect(request, lambda: end("disconnect")))
    try:
        yield
    except asyncio.CancelledError:
        if ended_by is None:
            raise  # cancelled from outside (the server stopping): not ours to swallow
        task.uncancel()
        if ended_by == "revoked":
            raise Unauthorized(_NO_LONGER_HOLDS) from None
        # "disconnect": left early, as a wait that ran out
    finally:
        holding = False
        if held is not None and owner is not None:
            owner.directory.release_stream(held)
        listener.cancel()
        await asyncio.wait((listener,))  # awaited, not raised: a cancel of this task still goes through
        if not listener.cancelled():
            listener.exception()  # retrieved: a receive that failed is the server's to report


async def _until_disconnect(request: Request, gone: Callable[[], None]) -> None:
    """Calls ``gone`` once the client has closed the connection (a held request has no body
    left for its route to read: whatever body it had is read and dropped here)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone()


def _authenticated(request: Request, svc: Services, principal: Principal) -> Principal:
    note_stream_owner(request, svc, principal.tenant, principal.key_id)
    return principal


def _refuse_portal_session(token: str, svc: Services) -> NoReturn:
    """A portal session outside ``/webhooks``: 403 if it is one; a token of that shape that is
    no session (forged, expired) is an unknown key, 401, as any other."""
    if portal_token_principal(svc.signer, token) is None:
        raise Unauthorized()
    raise PortalScope()


def _scoped(principal: Principal, scope: str) -> str:
    if scope not in principal.scopes:
        raise InsufficientScope(scope)
    return principal.tenant


def bearer_tenant(request: Request, svc: Services, scope: str) -> str | None:
    """The tenant of the request's API key; None without a valid one; 403 if the key lacks
    ``scope``. A portal session token is refused outright (403): it is valid only on the
    webhook routes."""
    token = _bearer_token(request)
    if token is None:
        return None
    if token.startswith(PORTAL_TOKEN_PREFIX):
        _refuse_portal_session(token, svc)
    principal = _principal(token, svc)
    return None if principal is None else _scoped(_authenticated(request, svc, principal), scope)


def require_principal(request: Request, svc: Services) -> Principal:
    token = _bearer_token(request)
    if token is None:
        raise Unauthorized()
    if token.startswith(PORTAL_TOKEN_PREFIX):
        _refuse_portal_session(token, svc)
    principal = _principal(token, svc)
    if principal is None:
        raise Unauthorized()
    return _authenticated(request, svc, principal)


def require_tenant(request: Request, svc: Services, scope: str) -> str:
    return _scoped(require_principal(request, svc), scope)


def require_scoped(request: Request, svc: Services, scope: str) -> Principal:
    """``require_tenant``, answering who it is: for a route that shows more to a key with more scopes."""
    principal = require_principal(request, svc)
    _scoped(principal, scope)
    return principal


def require_admin(request: Request, svc: Services) -> None:
    """The operator's ``HERALD_ADMIN_KEY``; unset, every /admin route is 401. A tenant's key: 403."""
    token = _bearer_token(request)
    admin_key = svc.settings.admin_key
    if token is not None and admin_key is not None and hmac.compare_digest(token.encode(), admin_key.encode()):
        return
    if admin_key is None:
        raise Unauthorized("the admin API is off: set HERALD_ADMIN_KEY on the gateway")
    if token is not None and not token.startswith(PORTAL_TOKEN_PREFIX) and svc.directory.authenticate(token):
        raise AdminOnly()
    raise Unauthorized("send Authorization: Bearer <HERALD_ADMIN_KEY>")


# ----- portal sessions ---------------------------------------------------------------------


def portal_binding(tenant: str, key_id: str) -> str:
    """What a portal link and session sign besides their path: the tenant and the key that made it."""
    return f"{tenant}|{key_id}"


def portal_token(signer: UrlSigner, tenant: str, key_id: str) -> str:
    exp, sig = signer.seal(PORTAL_SESSION_PATH, PORTAL_SESSION_PURPOSE, extra=portal_binding(tenant, key_id),
                           ttl_s=PORTAL_SESSION_S)
    name = base64.urlsafe_b64encode(tenant.encode()).decode().rstrip("=")
    return f"{PORTAL_TOKEN_PREFIX}{exp}.{name}.{key_id}.{sig}"


def portal_token_principal(signer: UrlSigner, token: str) -> tuple[str, str] | None:
    """``(tenant, key id)`` of a genuine, unexpired portal session token."""
    parts = token.removeprefix(PORTAL_TOKEN_PREFIX).split(".")
    if len(parts) != 4:
        return None
    exp, name, key_id, sig = parts
    try:
        tenant = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None
    if not tenant or len(tenant) > MAX_TENANT_LENGTH or not key_id or len(key_id) > MAX_KEY_ID_LENGTH:
        return None
    if not signer.verify(PORTAL_SESSION_PATH, PORTAL_SESSION_PURPOSE, exp, sig, extra=portal_binding(tenant, key_id)):
        return None
    return tenant, key_id


def require_webhook_tenant(request: Request, svc: Services) -> str:
    """The tenant of an API key with the ``webhooks`` scope, or of a live portal session."""
    token = _bearer_token(request)
    if token is not None and token.startswith(PORTAL_TOKEN_PREFIX):
        found = portal_token_principal(svc.signer, token)
        if found is None:
            raise Unauthorized("this portal session has expired or is not valid: open a fresh portal link")
        tenant, key_id = found
        if not svc.directory.key_live(key_id, tenant):
            raise Unauthorized("the key that opened this portal session was revoked, or its tenant disabled")
        note_stream_owner(request, svc, tenant, key_id)
        return tenant
    return require_tenant(request, svc, SCOPE_WEBHOOKS)
