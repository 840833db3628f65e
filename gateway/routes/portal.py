"""The webhook portal (SPEC §7): the page at ``/portal``, portal links and portal sessions.

* ``GET /portal`` serves the page (``static/portal.html``, no build step). Like ``/`` it
  needs no key: the page asks for one, or exchanges a portal link.
* ``POST /portal/link`` (API key only) signs a ``/portal`` URL for the tenant, valid
  ``HERALD_SIGNED_URL_TTL_S`` to open: an operator hands it to the people who receive the
  tenant's webhooks, or puts it behind a button of their own product.
* ``POST /portal/session`` is what the page does with a link's query: a valid one becomes
  a portal session token (``gateway.auth``) that opens the tenant's ``/webhooks`` routes,
  and nothing else, for ``PORTAL_SESSION_S``.
"""

from __future__ import annotations

from urllib.parse import quote

from litestar import Request, get, post
from litestar.enums import MediaType
from litestar.response import File

from gateway.auth import PORTAL_LINK_PURPOSE, PORTAL_SESSION_S, portal_binding, portal_token, require_principal
from gateway.problems import InsufficientScope
from herald.tenants import SCOPE_WEBHOOKS
from gateway.bodies import read_body
from gateway.openapi import problems, with_body
from gateway.problems import InvalidSignature
from gateway.render import NO_STORE
from gateway.routes.page import PAGE_HEADERS, REVALIDATE, STATIC_DIR
from gateway.services import services
from schemas.webhooks import PortalLink, PortalSession, PortalSessionRequest

PORTAL_PATH = "/portal"


@get(PORTAL_PATH, include_in_schema=False, media_type=MediaType.HTML, cache_control=REVALIDATE)
async def portal_page() -> File:
    """The webhook portal: endpoints, deliveries, attempts, resend, recover, test events."""
    return File(STATIC_DIR / "portal.html", filename="portal.html", content_disposition_type="inline",
                media_type=MediaType.HTML, headers=PAGE_HEADERS)


@post(f"{PORTAL_PATH}/link", operation_id="portal_link", tags=["webhooks"], status_code=200,
      summary="A signed /portal URL that opens the tenant's webhooks (not its jobs) without a key",
      responses=problems(401, 403), cache_control=NO_STORE)
async def portal_link(request: Request) -> PortalLink:
    """Valid ``HERALD_SIGNED_URL_TTL_S`` to open; once opened the page works for 8 hours.
    Only an API key can make one (a portal session cannot extend itself)."""
    svc = services(request)
    principal = require_principal(request, svc)
    if SCOPE_WEBHOOKS not in principal.scopes:
        raise InsufficientScope(SCOPE_WEBHOOKS)
    # The link, and the session it opens, are bound to this key: revoking it ends them.
    url = svc.signer.sign(PORTAL_PATH, PORTAL_LINK_PURPOSE, extra=portal_binding(principal.tenant, principal.key_id))
    return PortalLink(url=f"{url}&tenant={quote(principal.tenant, safe='')}&key={quote(principal.key_id, safe='')}",
                      expires_in=int(svc.settings.signed_url_ttl_s))


@post(f"{PORTAL_PATH}/session", operation_id="portal_session", tags=["webhooks"], status_code=200,
      summary="Exchange a portal link's tenant, exp and sig for a session token (bearer, /webhooks routes only)",
      operation_class=with_body(PortalSessionRequest, "The query of the portal link"),
      responses=problems(400, 403, 415), security=[])
async def portal_session(request: Request) -> PortalSession:
    svc = services(request)
    body, _document = await read_body(request, PortalSessionRequest)
    binding = portal_binding(body.tenant, body.key)
    if not svc.signer.verify(PORTAL_PATH, PORTAL_LINK_PURPOSE, body.exp, body.sig, extra=binding):
        raise InvalidSignature("this portal link is not valid or has expired: ask for a fresh one")
    if not svc.directory.key_live(body.key, body.tenant):
        raise InvalidSignature("the key that made this portal link was revoked, or its tenant disabled")
    return PortalSession(token=portal_token(svc.signer, body.tenant, body.key), tenant=body.tenant,
                         expires_in=PORTAL_SESSION_S)
