"""Every HTTP request gets a request id, a metrics sample and one access-log line.

Two pieces, because Litestar runs app-level middleware only for requests that matched a
route, while an unknown path (404) or a wrong method (405) must be counted and traced too:

* ``instrument(app)`` wraps the whole ASGI handler (as Litestar itself wraps it for
  CORS): it takes a sane incoming ``X-Request-ID`` or makes one, binds it to the
  structlog context for every line logged while the request runs, answers it in the
  ``X-Request-ID`` header, counts ``herald_http_requests_total{route,method,status}``
  by the route *template* (``/jobs/{job_id}``, never the raw path, so the label set
  stays bounded), and logs the access line with ``job_id`` when the route has one. Both
  name the method the client sent: a HEAD, which the app answers as a GET, is a HEAD.
* ``before_request`` is the app's hook, run once the route is known and before the framework
  reads the request's parameters: it binds ``job_id`` (``bind_job_context``) so that every
  line a handler logs about a job carries it, then checks the query string against what the
  route declares (``gateway.query``).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

import structlog
from litestar import Litestar, Request
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.headers import SENT_METHOD
from gateway.problems import InvalidRequest, Misdirected
from gateway.query import check_query
from gateway.services import services
from herald.logs import log_event
from herald.metrics import Metrics
from herald.metrics import metrics as process_metrics
from herald.settings import Settings, is_loopback_host
from schemas.problems import FieldError

log = logging.getLogger("herald.http")

REQUEST_ID_HEADER = b"x-request-id"
NOSNIFF = (b"x-content-type-options", b"nosniff")
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}")
UNMATCHED_ROUTE = "unmatched"  # 404 for an unknown path, 405 for a known path with a wrong method
_QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})  # probes and scrapes: debug level


def request_id_from(scope: Scope) -> str:
    """The client's ``X-Request-ID`` when it is sane (1..128 safe characters), else a new one."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            if _SANE_REQUEST_ID.fullmatch(value):
                return value.decode()
            break
    return uuid.uuid4().hex


class RequestContext:
    """The outermost ASGI layer of the gateway (see the module docstring)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        # The labelled children, looked up once per label set: ``labels()`` validates and
        # locks on every call. As bounded as the label sets themselves.
        self._counted: dict[tuple[str, str, int], Any] = {}
        self._timed: dict[tuple[str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        header = (REQUEST_ID_HEADER, request_id.encode())
        status = 500  # if no answer starts, the server failed
        started = time.perf_counter()
        started_job: str | None = None  # a start's (or its replay's) job, named by its Location

        async def send_with_id(message: Message) -> None:
            nonlocal status, started_job
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 202:
                    started_job = _job_of_location(message.get("headers", ()))
                headers = [*message.get("headers", ()), header]
                # Every answer, downloads and problems alike, is what its Content-Type says:
                # a browser must not sniff a result (or an echoed value) into HTML or script.
                if not any(name.lower() == NOSNIFF[0] for name, _ in headers):
                    headers.append(NOSNIFF)
                message["headers"] = headers
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                self._record(scope, status, time.perf_counter() - started, started_job)
                structlog.contextvars.unbind_contextvars("job_id")  # bound by bind_job_context

    def _record(self, scope: Scope, status: int, elapsed: float, started_job: str | None = None) -> None:
        # The router writes the matched template into this same scope dict.
        route: str = scope.get("path_template") or UNMATCHED_ROUTE
        # ``edge`` runs a HEAD as a GET in a copy of the scope that says what was sent.
        method = str(scope.get(SENT_METHOD) or scope.get("method", ""))
        counted = self._counted.get((route, method, status))
        if counted is None:
            counted = self._counted[(route, method, status)] = self.metrics.http_requests.labels(
                route=route, method=method, status=str(status))
        counted.inc()
        timed = self._timed.get((route, method))
        if timed is None:
            timed = self._timed[(route, method)] = self.metrics.http_request_seconds.labels(route=route, method=method)
        timed.observe(elapsed)
        fields: dict[str, Any] = {"method": method, "route": route, "path": scope.get("path", ""), "status": status,
                  "duration_ms": round(elapsed * 1000, 1)}
        job_id = (scope.get("path_params") or {}).get("job_id") or started_job
        if job_id is not None:
            fields["job_id"] = job_id
        log_event(log, logging.DEBUG if route in _QUIET_ROUTES else logging.INFO, "request", fields)


def _job_of_location(headers: Any) -> str | None:
    for name, value in headers:
        if name.lower() == b"location" and value.startswith(b"/jobs/"):
            return bytes(value[len(b"/jobs/"):]).decode("latin-1")
    return None


async def bind_job_context(request: Request[Any, Any, Any]) -> None:
    """``before_request`` hook: bind the route's ``job_id`` for the handler's log lines."""
    job_id = request.path_params.get("job_id")
    if job_id is not None:
        structlog.contextvars.bind_contextvars(job_id=job_id)


def host_served(host: str | None, settings: Settings) -> bool:
    """Whether a request naming ``host`` (its Host header) is for this gateway.

    A gateway bound to loopback is reachable from this machine only, yet a browser on it can
    be led there by DNS rebinding: a page whose name is made to resolve to 127.0.0.1 calls it
    as its own origin, reads the answers, and sends the public ``dev-key``. Such a request names
    the page's host, so it is refused; loopback names and addresses, and ``HERALD_ALLOWED_HOSTS``,
    are served. Bound beyond loopback, any Host is (the operator chose who can reach it)."""
    if not is_loopback_host(settings.http_host) or not host:
        return True  # no Host at all is HTTP/1.0, which no browser sends
    name = host.partition("]")[0].removeprefix("[") if host.startswith("[") else host.partition(":")[0]
    name = name.lower().removesuffix(".")
    return (is_loopback_host(name) or name.endswith(".localhost")
            or name in (allowed.lower() for allowed in settings.allowed_hosts))


def check_host_header(request: Request[Any, Any, Any]) -> None:
    """RFC 9112 §3.2: an HTTP/1.1 request without a Host, or with several, is a 400. The
    server under the app serves both, and ``host_served`` would judge the first of several
    only, or wave a missing one through as HTTP/1.0's."""
    sent = request.headers.getall("host", [])
    if len(sent) > 1:
        raise InvalidRequest([FieldError(field="Host", message="send one Host header, not several")])
    if not sent and request.scope.get("http_version") != "1.0":
        raise InvalidRequest([FieldError(field="Host", message="an HTTP/1.1 request must name its Host")])


async def before_request(request: Request[Any, Any, Any]) -> None:
    """The app's ``before_request`` hook (see the module docstring)."""
    check_host_header(request)
    if not host_served(request.headers.get("host"), services(request).settings):
        raise Misdirected("this gateway listens on loopback and answers only a loopback Host "
                          "(set HERALD_ALLOWED_HOSTS for a reverse proxy's name)")
    await bind_job_context(request)
    check_query(request)


def instrument(app: Litestar, metrics: Metrics | None = None) -> Litestar:
    """Wrap ``app``'s ASGI handler in ``RequestContext``; returns ``app`` for chaining."""
    app.asgi_handler = RequestContext(app.asgi_handler, metrics or process_metrics())
    return app
