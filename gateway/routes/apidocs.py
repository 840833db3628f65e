"""The API browser at ``/schema`` (SPEC §10): Swagger UI from the ``swagger-ui-py`` wheel,
served by Herald itself under the same strict CSP as the other pages.

Litestar's own renderers (swagger, redoc, rapidoc, elements, stoplight, scalar) load their
scripts from a CDN, unpinned and without integrity hashes, on the origin where the pages keep
an API key: so only two renderers are configured, the JSON document and this page. The page
is static HTML with no inline code: ``static/api.js`` starts Swagger UI on the JSON document.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from litestar import MediaType, Request, Response, Router, get
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin
from litestar.params import FromPath
from litestar.response import File

from gateway.problems import NotFound, problem_response
from gateway.routes.page import PAGE_HEADERS, STATIC_DIR

SCHEMA_PATH = "/schema"
# The vendored files the page uses, and nothing else of the wheel.
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}
_SWAGGER_STATIC = files("swagger_ui") / "static"


class ApiBrowser(OpenAPIRenderPlugin):
    """``GET /schema``: the page; ``GET /schema/assets/{name}``: Swagger UI's script and styles."""

    def __init__(self) -> None:
        super().__init__(path="/")
        self._page = (STATIC_DIR / "api.html").read_bytes()

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return self._page

    def receive_router(self, router: Router) -> None:
        router.register(swagger_asset)


@get("/assets/{name:str}", include_in_schema=False, sync_to_thread=False)
def swagger_asset(name: FromPath[str]) -> File:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound("no such file")
    return File(str(_SWAGGER_STATIC / name), filename=name, content_disposition_type="inline",
                media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})


def _problem_not_html(response: Response[Any]) -> Response[Any]:
    """Litestar's OpenAPI router answers any other path under it with an HTML 404 page of its
    own (a catch-all route, not an exception): a problem, as every other 4xx of Herald's."""
    if response.status_code == 404 and response.media_type == MediaType.HTML:
        return problem_response(NotFound(f"no such page under {SCHEMA_PATH}: the API browser is {SCHEMA_PATH}, "
                                         f"the document {SCHEMA_PATH}/openapi.json").problem)
    return response


def schema_router() -> Router:
    """Where the OpenAPI routes live: every answer under ``/schema`` carries the pages' CSP."""
    return Router(SCHEMA_PATH, route_handlers=[], response_headers=PAGE_HEADERS, include_in_schema=False,
                  dto=None, return_dto=None, after_request=_problem_not_html)


def render_plugins() -> list[OpenAPIRenderPlugin]:
    return [JsonRenderPlugin(), ApiBrowser()]
