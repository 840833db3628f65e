"""The browser page at ``/`` and its two assets (SPEC §2: no key needed, §8: works from a browser).

Plain files, no build step: ``static/index.html``, ``static/app.js``, ``static/app.css``.
They are not part of the API, so they stay out of the OpenAPI document.
"""

from __future__ import annotations

from pathlib import Path

from litestar import get
from litestar.datastructures import CacheControlHeader
from litestar.enums import MediaType
from litestar.params import FromPath
from litestar.response import File

from gateway.problems import NotFound

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
ASSETS = {"app.js": "text/javascript", "app.css": "text/css",
          "portal.js": "text/javascript", "portal.css": "text/css",
          "api.js": "text/javascript", "favicon.svg": "image/svg+xml"}
REVALIDATE = CacheControlHeader(no_cache=True)  # an upgraded gateway's page is seen at once

# The page keeps an API key in localStorage, so it runs only its own script: no inline
# code, no other origin (injected markup could otherwise read the key). form-action
# 'none' stops a form from ever being submitted natively (a GET would put the key in the URL)
# if the script has not loaded.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@get("/", include_in_schema=False, media_type=MediaType.HTML, cache_control=REVALIDATE)
async def index() -> File:
    """The page: start reports and watch every job of the tenant over one event stream."""
    # Named, or Litestar's File says `inline; filename=""`, an empty name a browser saving the page must guess.
    return File(STATIC_DIR / "index.html", filename="index.html", content_disposition_type="inline",
                media_type=MediaType.HTML, headers=PAGE_HEADERS)


@get("/static/{name:str}", include_in_schema=False, cache_control=REVALIDATE)
async def asset(name: FromPath[str]) -> File:
    """The page's script and style sheet; nothing else in the folder is served."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound("no such file")
    return File(STATIC_DIR / name, filename=name, content_disposition_type="inline", media_type=media_type,
                headers={"X-Content-Type-Options": "nosniff"})
