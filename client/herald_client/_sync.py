"""The blocking client: the flows of ``_core`` driven by ``httpx.Client``."""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable, Collection, Generator, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, overload

import httpx
import msgspec

from herald_client import _admin
from herald_client import _core
from herald_client import _endpoints
from herald_client._admin import LimitsArg
from herald_client._endpoints import KEEP, _Keep
from herald_client.models import (
    ApiKey,
    AuditEntry,
    AuditList,
    CreatedEndpoint,
    CreatedKey,
    KeyList,
    Tenant,
    TenantList,
    Delivery,
    DeliveryList,
    Endpoint,
    EndpointList,
    PortalLink,
    SigningSecret,
)
from herald_client._core import Call, Context, Emit, Failure, Flow, Open, Read, Reply, Request, Save, Saved, Sleep
from herald_client._shared import (
    AUTO,
    IdempotencyKey,
    bearer,
    collection_path,
    describe,
    encode_params,
    job_id,
    reply_headers,
    resolve_key,
    url_for,
)
from herald_client.models import Download, JobEvent, JobStatus, OutputChunk, Result
from herald_client.policy import Policy

T = TypeVar("T")


class _Driver:
    """The blocking transport both clients share: one ``httpx.Client``, a bearer key, and
    the loop that performs a flow's actions."""

    def __init__(self, url: str, key: str, *, timeout: float, policy: Policy, http: httpx.Client | None,
                 rng: random.Random | None) -> None:
        self._base = url.rstrip("/")
        self._headers = bearer(key)
        self._timeout = httpx.Timeout(timeout)
        self._stream_timeout = httpx.Timeout(timeout, read=policy.stream_read_timeout)
        self._ctx = Context(policy=policy, rng=rng or random.Random())
        self._owns_http = http is None
        self._http = http if http is not None else httpx.Client()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ----- the driver -------------------------------------------------------------------

    def _run(self, flow: Flow[T], on_emit: Callable[[Any], None] | None = None) -> T:
        driver = self._drive(flow)
        while True:
            try:
                value = next(driver)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if on_emit is not None:
                on_emit(value)

    def _drive(self, flow: Flow[T]) -> Generator[Any, None, T]:
        """Perform the flow's actions; yield what it emits; return what it returns."""
        opened: httpx.Response | None = None
        chunks: Iterator[bytes] | None = None
        outcome: Any = None
        try:
            while True:
                try:
                    action = flow.send(outcome)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                outcome = None
                match action:
                    case Call(request=request):
                        outcome = self._call(request)
                    case Sleep(seconds=seconds):
                        time.sleep(seconds)
                    case Open(request=request):
                        if opened is not None:
                            opened.close()
                        outcome, opened = self._open(request)
                        chunks = opened.iter_bytes() if opened is not None else None
                    case Read():
                        outcome = self._read(chunks)
                    case Save(request=request, directory=directory):
                        outcome = self._save(request, directory)
                    case Emit(value=value):
                        yield value
        finally:
            if opened is not None:
                opened.close()
            flow.close()

    def _build(self, request: Request, timeout: httpx.Timeout) -> httpx.Request:
        return self._http.build_request(request.method, url_for(self._base, request.path),
                                        headers={**self._headers, **request.headers}, content=request.body,
                                        timeout=timeout)

    def _call(self, request: Request) -> Reply | Failure:
        try:
            response = self._http.send(self._build(request, self._timeout), follow_redirects=False)
        except httpx.RequestError as exc:
            return Failure(describe(exc))
        return Reply(response.status_code, reply_headers(response.headers), response.content)

    def _open(self, request: Request) -> tuple[Reply | Failure, httpx.Response | None]:
        try:
            response = self._http.send(self._build(request, self._stream_timeout), stream=True,
                                       follow_redirects=False)
        except httpx.RequestError as exc:
            return Failure(describe(exc)), None
        headers = reply_headers(response.headers)
        if response.status_code == 200:
            return Reply(200, headers), response
        try:
            body = response.read()
        except httpx.RequestError as exc:
            return Failure(describe(exc)), None
        finally:
            response.close()
        return Reply(response.status_code, headers, body), None

    @staticmethod
    def _read(chunks: Iterator[bytes] | None) -> bytes | Failure:
        if chunks is None:
            return b""
        try:
            return next(chunks, b"")
        except httpx.RequestError as exc:
            return Failure(describe(exc))

    def _save(self, request: Request, directory: Path) -> Saved | Failure:
        try:
            with self._http.stream(request.method, url_for(self._base, request.path),
                                   headers={**self._headers, **request.headers}, timeout=self._stream_timeout,
                                   follow_redirects=False) as response:
                reply = Reply(response.status_code, reply_headers(response.headers))
                if response.status_code != 200:
                    return Saved(Reply(reply.status, reply.headers, response.read()), None)
                fd, name = tempfile.mkstemp(dir=directory, prefix=".herald-", suffix=".part")
                size = 0
                try:
                    with os.fdopen(fd, "wb") as file:
                        for chunk in response.iter_bytes():
                            file.write(chunk)
                            size += len(chunk)
                except BaseException:
                    os.unlink(name)
                    raise
                return Saved(reply, Path(name), size)
        except httpx.RequestError as exc:
            return Failure(describe(exc))


class HeraldClient(_Driver):
    """A blocking Herald client. Use it as a context manager, or call ``close()``.

    ``http``: an ``httpx.Client`` of your own (proxies, TLS, event hooks); you then close
    it yourself. Every call sends the key and a timeout of its own, so any client will do.
    """

    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        timeout: float = 10.0,
        policy: Policy = Policy(),
        collections: Mapping[str, str] | None = None,
        http: httpx.Client | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(url, api_key, timeout=timeout, policy=policy, http=http, rng=rng)
        self._collections = dict(collections or {})

    # ----- the API ----------------------------------------------------------------------

    def submit(self, kind: str, params: Mapping[str, Any] | msgspec.Struct, *,
               idempotency_key: IdempotencyKey = AUTO) -> JobStatus:
        """Start a job of ``kind`` (``"report"``, ``"export"``, or a path like ``"/reports"``).

        With a key (by default a fresh UUID), a lost answer — no reply, a 5xx, a 429/503 —
        is retried with the same key, so the job is started exactly once. With
        ``idempotency_key=None`` only answers that prove nothing was started (429/503)
        are retried.
        """
        flow = _core.submit(collection_path(kind, self._collections), encode_params(params),
                            resolve_key(idempotency_key), self._ctx)
        return self._run(flow)

    def status(self, job: JobStatus | str) -> JobStatus:
        """The job's current status (one ``GET /jobs/{id}``, not following the 303)."""
        return self._run(_core.status(job_id(job), self._ctx))

    @overload
    def wait(self, job: JobStatus | str, timeout: float | None = ..., *, follow: Literal[False] = ...,
             on_update: Callable[[JobStatus], None] | None = ...) -> JobStatus: ...

    @overload
    def wait(self, job: JobStatus | str, timeout: float | None = ..., *, follow: Literal[True],
             on_update: Callable[[JobStatus], None] | None = ...) -> Result: ...

    def wait(self, job: JobStatus | str, timeout: float | None = None, *, follow: bool = False,
             on_update: Callable[[JobStatus], None] | None = None) -> JobStatus | Result:
        """Poll until the job ends; return its terminal status, or with ``follow`` its result.

        Raises ``WaitTimeout`` after ``timeout`` seconds (None: no limit), and with
        ``follow`` ``JobNotSucceeded`` when it failed or was cancelled. ``on_update`` is
        called with every new version seen.
        """
        return self._run(_core.wait(job_id(job), timeout, follow, self._ctx), on_emit=on_update)

    def stream(self, job: JobStatus | str, *, last_event_id: str | None = None) -> Iterator[JobEvent]:
        """The job's server-sent events until its terminal one, resuming after dropped connections."""
        return self._drive(_core.stream(job_id(job), last_event_id, self._ctx))

    def output(self, job: JobStatus | str, *, after: int | None = None) -> Iterator[OutputChunk]:
        """The job's streamed output chunks (SPEC §8), live, until the job has ended; resumes
        by itself after a dropped connection (nothing missed, nothing twice). ``after``: start
        after that chunk number."""
        return self._drive(_core.output(job_id(job), after, self._ctx))

    def download(self, job: JobStatus | str, path: str | os.PathLike[str] | None = None) -> Download:
        """Save a succeeded job's result to ``path`` (a file or a directory; default: the cwd)."""
        target = Path(path) if path is not None else None
        return self._run(_core.download(job_id(job), target, self._ctx))

    def cancel(self, job: JobStatus | str) -> JobStatus:
        """Cancel (queued: at once; running: requested, the worker stops between steps)."""
        return self._run(_core.cancel(job_id(job), self._ctx))

    # ----- webhooks (SPEC §7): what the webhook portal does, as calls --------------------

    def create_webhook(self, url: str, *, event_types: Sequence[str] | None = None,
                       kinds: Sequence[str] | None = None, signature: str = "hmac-sha256") -> CreatedEndpoint:
        """Register an endpoint (default: every event type but job.progress, every kind). The
        answer carries ``secret`` (``whsec_…``) or, for ``ed25519``, ``public_key``: shown this once."""
        return self._run(_endpoints.create(url, event_types, kinds, signature, self._ctx))

    def list_webhooks(self, *, limit: int | None = None, cursor: str | None = None) -> EndpointList:
        """The tenant's endpoints, newest first, with their health; ``next_cursor`` pages on."""
        return self._run(_endpoints.listing(limit, cursor, self._ctx))

    def webhook(self, endpoint: Endpoint | str) -> Endpoint:
        return self._run(_endpoints.get(endpoint, self._ctx))

    def update_webhook(self, endpoint: Endpoint | str, *, url: str | None = None,
                       event_types: Sequence[str] | None = None, kinds: Sequence[str] | None | _Keep = KEEP,
                       status: str | None = None) -> Endpoint:
        """Change what is given: ``url``, ``event_types``, ``kinds`` (None: every kind), ``status``
        (``"enabled"`` / ``"disabled"``: pause and resume)."""
        return self._run(_endpoints.update(endpoint, url, event_types, kinds, status, self._ctx))

    def delete_webhook(self, endpoint: Endpoint | str) -> None:
        """Delete the endpoint with its delivery log."""
        self._run(_endpoints.delete(endpoint, self._ctx))

    def rotate_webhook_secret(self, endpoint: Endpoint | str) -> SigningSecret:
        """A new secret (or key pair); the old one keeps signing for 24 h beside it."""
        return self._run(_endpoints.rotate(endpoint, self._ctx))

    def webhook_deliveries(self, endpoint: Endpoint | str, *, status: str | None = None, limit: int | None = None,
                           cursor: str | None = None) -> DeliveryList:
        """The endpoint's deliveries, newest first, each with its attempts and signed payload."""
        return self._run(_endpoints.deliveries(endpoint, status, limit, cursor, self._ctx))

    def webhook_delivery(self, endpoint: Endpoint | str, delivery: Delivery | str) -> Delivery:
        return self._run(_endpoints.delivery(endpoint, delivery, self._ctx))

    def retry_delivery(self, endpoint: Endpoint | str, delivery: Delivery | str) -> Delivery:
        """Send the delivery again now, with the same ``webhook-id``, whatever its status."""
        return self._run(_endpoints.retry(endpoint, delivery, self._ctx))

    def recover_webhook(self, endpoint: Endpoint | str, since: datetime | str) -> int:
        """Send again every failed delivery of the endpoint created since ``since`` (an aware
        datetime or RFC 3339 text); how many."""
        return self._run(_endpoints.recover(endpoint, since, self._ctx))

    def send_test_event(self, endpoint: Endpoint | str) -> Delivery:
        """A signed ``webhook.test`` delivery to the endpoint, through the same queue as every event."""
        return self._run(_endpoints.send_test(endpoint, self._ctx))

    def portal_link(self) -> PortalLink:
        """A signed ``/portal`` URL (path-absolute) that opens the tenant's webhooks, not its jobs,
        without a key: valid ``HERALD_SIGNED_URL_TTL_S`` to open."""
        return self._run(_endpoints.portal_link(self._ctx))

    def callback_secret(self) -> SigningSecret:
        """The secret that signs deliveries to jobs' ``callback_url``."""
        return self._run(_endpoints.callback_secret(self._ctx))

    def rotate_callback_secret(self) -> SigningSecret:
        return self._run(_endpoints.rotate_callback_secret(self._ctx))


class HeraldAdmin(_Driver):
    """The operator's blocking client for the admin API (SPEC §12), with ``HERALD_ADMIN_KEY``:
    tenants, their keys, the audit log. A tenant key gets ``Forbidden`` here.

    Listings are iterators that fetch the next page when the previous one is used up.
    """

    def __init__(self, url: str, admin_key: str, *, timeout: float = 10.0, policy: Policy = Policy(),
                 http: httpx.Client | None = None, rng: random.Random | None = None) -> None:
        super().__init__(url, admin_key, timeout=timeout, policy=policy, http=http, rng=rng)

    def create_tenant(self, tenant: str, limits: LimitsArg | None = None) -> Tenant:
        """A new tenant (``id`` matching ``^[a-z0-9][a-z0-9_-]{0,62}$``); limits not given are
        the deployment's defaults. ``Conflict`` if the id is taken."""
        return self._run(_admin.create_tenant(tenant, limits, self._ctx))

    def list_tenants(self, *, page_size: int | None = None) -> Iterator[Tenant]:
        """Every tenant, those of ``HERALD_API_KEYS`` too (``source == "env"``)."""
        return self._drive(_admin.each(_admin.TENANTS, TenantList, page_size, self._ctx))

    def get_tenant(self, tenant: Tenant | str) -> Tenant:
        return self._run(_admin.get_tenant(tenant, self._ctx))

    def update_tenant(self, tenant: Tenant | str, *, limits: LimitsArg | None = None,
                      disabled: bool | None = None) -> Tenant:
        """Change only what is given. ``disabled=True``: its keys and portal sessions get 401
        (its running jobs finish and their webhooks go out); ``False`` enables it again."""
        return self._run(_admin.update_tenant(tenant, limits, disabled, self._ctx))

    def create_key(self, tenant: Tenant | str, name: str, *, scopes: Collection[str] | None = None,
                   expires_at: datetime | str | None = None) -> CreatedKey:
        """A new key for the tenant (``scopes`` default: all of ``jobs:read``, ``jobs:write``,
        ``webhooks``). The answer's ``key`` (``hk_…``) is shown this once. Sent once: a lost
        answer is not retried, since a retry would make a second key."""
        return self._run(_admin.create_key(tenant, name, scopes, expires_at, self._ctx))

    def list_keys(self, tenant: Tenant | str, *, page_size: int | None = None) -> Iterator[ApiKey]:
        """The tenant's keys, without the keys themselves, each with ``last_used_at`` (to the minute)."""
        return self._drive(_admin.each(_admin.keys_path(tenant), KeyList, page_size, self._ctx))

    def revoke_key(self, key: ApiKey | str) -> None:
        """Revoke a key: within 2 s it gets 401 on every gateway, and so do the portal sessions
        opened with it. ``Conflict`` for a key of ``HERALD_API_KEYS`` (configuration)."""
        self._run(_admin.revoke_key(key, self._ctx))

    def audit(self, *, page_size: int | None = None) -> Iterator[AuditEntry]:
        """The audit log, newest first: who was created, changed, disabled, revoked, when."""
        return self._drive(_admin.each(_admin.AUDIT, AuditList, page_size, self._ctx))
