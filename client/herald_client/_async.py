"""The asyncio client: the flows of ``_core`` driven by ``httpx.AsyncClient``.

Only the driver differs from ``HeraldClient``: every decision lives in the flows.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, Literal, Self, TypeVar, overload

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


@dataclass(frozen=True, slots=True)
class _Done(Generic[T]):
    value: T


class _Driver:
    """The asyncio transport both clients share: one ``httpx.AsyncClient``, a bearer key,
    and the loop that performs a flow's actions."""

    def __init__(self, url: str, key: str, *, timeout: float, policy: Policy, http: httpx.AsyncClient | None,
                 rng: random.Random | None) -> None:
        self._base = url.rstrip("/")
        self._headers = bearer(key)
        self._timeout = httpx.Timeout(timeout)
        self._stream_timeout = httpx.Timeout(timeout, read=policy.stream_read_timeout)
        self._ctx = Context(policy=policy, rng=rng or random.Random())
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient()

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    # ----- the driver -------------------------------------------------------------------

    async def _run(self, flow: Flow[T], on_emit: Callable[[Any], None] | None = None) -> T:
        async with aclosing(self._drive(flow)) as driver:
            async for item in driver:
                if isinstance(item, _Done):
                    return item.value  # type: ignore[no-any-return]
                if on_emit is not None:
                    on_emit(item)
        raise AssertionError("the driver ended without a result")

    async def _emitted(self, flow: Flow[Any]) -> AsyncGenerator[Any, None]:
        """What the flow emits, as an async iterator (a listing's items, page after page)."""
        async with aclosing(self._drive(flow)) as driver:
            async for item in driver:
                if not isinstance(item, _Done):
                    yield item

    async def _drive(self, flow: Flow[T]) -> AsyncGenerator[Any, None]:
        """Perform the flow's actions; yield what it emits, then ``_Done(result)``."""
        opened: httpx.Response | None = None
        chunks: AsyncIterator[bytes] | None = None
        outcome: Any = None
        try:
            while True:
                try:
                    action = flow.send(outcome)
                except StopIteration as stop:
                    yield _Done(stop.value)
                    return
                outcome = None
                match action:
                    case Call(request=request):
                        outcome = await self._call(request)
                    case Sleep(seconds=seconds):
                        await asyncio.sleep(seconds)
                    case Open(request=request):
                        if opened is not None:
                            await opened.aclose()
                        outcome, opened = await self._open(request)
                        chunks = opened.aiter_bytes() if opened is not None else None
                    case Read():
                        outcome = await self._read(chunks)
                    case Save(request=request, directory=directory):
                        outcome = await self._save(request, directory)
                    case Emit(value=value):
                        yield value
        finally:
            if opened is not None:
                await opened.aclose()
            flow.close()

    def _build(self, request: Request, timeout: httpx.Timeout) -> httpx.Request:
        return self._http.build_request(request.method, url_for(self._base, request.path),
                                        headers={**self._headers, **request.headers}, content=request.body,
                                        timeout=timeout)

    async def _call(self, request: Request) -> Reply | Failure:
        try:
            response = await self._http.send(self._build(request, self._timeout), follow_redirects=False)
        except httpx.RequestError as exc:
            return Failure(describe(exc))
        return Reply(response.status_code, reply_headers(response.headers), response.content)

    async def _open(self, request: Request) -> tuple[Reply | Failure, httpx.Response | None]:
        try:
            response = await self._http.send(self._build(request, self._stream_timeout), stream=True,
                                             follow_redirects=False)
        except httpx.RequestError as exc:
            return Failure(describe(exc)), None
        headers = reply_headers(response.headers)
        if response.status_code == 200:
            return Reply(200, headers), response
        try:
            body = await response.aread()
        except httpx.RequestError as exc:
            return Failure(describe(exc)), None
        finally:
            await response.aclose()
        return Reply(response.status_code, headers, body), None

    @staticmethod
    async def _read(chunks: AsyncIterator[bytes] | None) -> bytes | Failure:
        if chunks is None:
            return b""
        try:
            return await anext(chunks, b"")
        except httpx.RequestError as exc:
            return Failure(describe(exc))

    async def _save(self, request: Request, directory: Path) -> Saved | Failure:
        # File writes are small and local; they run on the loop (as aiofiles would, per chunk).
        try:
            async with self._http.stream(request.method, url_for(self._base, request.path),
                                         headers={**self._headers, **request.headers},
                                         timeout=self._stream_timeout, follow_redirects=False) as response:
                reply = Reply(response.status_code, reply_headers(response.headers))
                if response.status_code != 200:
                    return Saved(Reply(reply.status, reply.headers, await response.aread()), None)
                fd, name = tempfile.mkstemp(dir=directory, prefix=".herald-", suffix=".part")
                size = 0
                try:
                    with os.fdopen(fd, "wb") as file:
                        async for chunk in response.aiter_bytes():
                            file.write(chunk)
                            size += len(chunk)
                except BaseException:
                    os.unlink(name)
                    raise
                return Saved(reply, Path(name), size)
        except httpx.RequestError as exc:
            return Failure(describe(exc))


class AsyncHeraldClient(_Driver):
    """An asyncio Herald client. Use it as an async context manager, or ``await close()``.

    ``http``: an ``httpx.AsyncClient`` of your own; you then close it yourself.
    """

    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        timeout: float = 10.0,
        policy: Policy = Policy(),
        collections: Mapping[str, str] | None = None,
        http: httpx.AsyncClient | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(url, api_key, timeout=timeout, policy=policy, http=http, rng=rng)
        self._collections = dict(collections or {})

    # ----- the API (same promises as HeraldClient) ------------------------------------

    async def submit(self, kind: str, params: Mapping[str, Any] | msgspec.Struct, *,
                     idempotency_key: IdempotencyKey = AUTO) -> JobStatus:
        """See ``HeraldClient.submit``."""
        flow = _core.submit(collection_path(kind, self._collections), encode_params(params),
                            resolve_key(idempotency_key), self._ctx)
        return await self._run(flow)

    async def status(self, job: JobStatus | str) -> JobStatus:
        return await self._run(_core.status(job_id(job), self._ctx))

    @overload
    async def wait(self, job: JobStatus | str, timeout: float | None = ..., *, follow: Literal[False] = ...,
                   on_update: Callable[[JobStatus], None] | None = ...) -> JobStatus: ...

    @overload
    async def wait(self, job: JobStatus | str, timeout: float | None = ..., *, follow: Literal[True],
                   on_update: Callable[[JobStatus], None] | None = ...) -> Result: ...

    async def wait(self, job: JobStatus | str, timeout: float | None = None, *, follow: bool = False,
                   on_update: Callable[[JobStatus], None] | None = None) -> JobStatus | Result:
        """See ``HeraldClient.wait``."""
        return await self._run(_core.wait(job_id(job), timeout, follow, self._ctx), on_emit=on_update)

    async def output(self, job: JobStatus | str, *, after: int | None = None) -> AsyncIterator[OutputChunk]:
        """See ``HeraldClient.output``."""
        async with aclosing(self._drive(_core.output(job_id(job), after, self._ctx))) as driver:
            async for item in driver:
                if not isinstance(item, _Done):
                    yield item

    async def stream(self, job: JobStatus | str, *, last_event_id: str | None = None) -> AsyncIterator[JobEvent]:
        """See ``HeraldClient.stream``."""
        async with aclosing(self._drive(_core.stream(job_id(job), last_event_id, self._ctx))) as driver:
            async for item in driver:
                if not isinstance(item, _Done):
                    yield item

    async def download(self, job: JobStatus | str, path: str | os.PathLike[str] | None = None) -> Download:
        target = Path(path) if path is not None else None
        return await self._run(_core.download(job_id(job), target, self._ctx))

    async def cancel(self, job: JobStatus | str) -> JobStatus:
        return await self._run(_core.cancel(job_id(job), self._ctx))

    # ----- webhooks (SPEC §7): what the webhook portal does, as calls --------------------

    async def create_webhook(self, url: str, *, event_types: Sequence[str] | None = None,
                       kinds: Sequence[str] | None = None, signature: str = "hmac-sha256") -> CreatedEndpoint:
        """Register an endpoint (default: every event type but job.progress, every kind). The
        answer carries ``secret`` (``whsec_…``) or, for ``ed25519``, ``public_key``: shown this once."""
        return await self._run(_endpoints.create(url, event_types, kinds, signature, self._ctx))

    async def list_webhooks(self, *, limit: int | None = None, cursor: str | None = None) -> EndpointList:
        """The tenant's endpoints, newest first, with their health; ``next_cursor`` pages on."""
        return await self._run(_endpoints.listing(limit, cursor, self._ctx))

    async def webhook(self, endpoint: Endpoint | str) -> Endpoint:
        return await self._run(_endpoints.get(endpoint, self._ctx))

    async def update_webhook(self, endpoint: Endpoint | str, *, url: str | None = None,
                       event_types: Sequence[str] | None = None, kinds: Sequence[str] | None | _Keep = KEEP,
                       status: str | None = None) -> Endpoint:
        """Change what is given: ``url``, ``event_types``, ``kinds`` (None: every kind), ``status``
        (``"enabled"`` / ``"disabled"``: pause and resume)."""
        return await self._run(_endpoints.update(endpoint, url, event_types, kinds, status, self._ctx))

    async def delete_webhook(self, endpoint: Endpoint | str) -> None:
        """Delete the endpoint with its delivery log."""
        await self._run(_endpoints.delete(endpoint, self._ctx))

    async def rotate_webhook_secret(self, endpoint: Endpoint | str) -> SigningSecret:
        """A new secret (or key pair); the old one keeps signing for 24 h beside it."""
        return await self._run(_endpoints.rotate(endpoint, self._ctx))

    async def webhook_deliveries(self, endpoint: Endpoint | str, *, status: str | None = None, limit: int | None = None,
                           cursor: str | None = None) -> DeliveryList:
        """The endpoint's deliveries, newest first, each with its attempts and signed payload."""
        return await self._run(_endpoints.deliveries(endpoint, status, limit, cursor, self._ctx))

    async def webhook_delivery(self, endpoint: Endpoint | str, delivery: Delivery | str) -> Delivery:
        return await self._run(_endpoints.delivery(endpoint, delivery, self._ctx))

    async def retry_delivery(self, endpoint: Endpoint | str, delivery: Delivery | str) -> Delivery:
        """Send the delivery again now, with the same ``webhook-id``, whatever its status."""
        return await self._run(_endpoints.retry(endpoint, delivery, self._ctx))

    async def recover_webhook(self, endpoint: Endpoint | str, since: datetime | str) -> int:
        """Send again every failed delivery of the endpoint created since ``since`` (an aware
        datetime or RFC 3339 text); how many."""
        return await self._run(_endpoints.recover(endpoint, since, self._ctx))

    async def send_test_event(self, endpoint: Endpoint | str) -> Delivery:
        """A signed ``webhook.test`` delivery to the endpoint, through the same queue as every event."""
        return await self._run(_endpoints.send_test(endpoint, self._ctx))

    async def portal_link(self) -> PortalLink:
        """A signed ``/portal`` URL (path-absolute) that opens the tenant's webhooks, not its jobs,
        without a key: valid ``HERALD_SIGNED_URL_TTL_S`` to open."""
        return await self._run(_endpoints.portal_link(self._ctx))

    async def callback_secret(self) -> SigningSecret:
        """The secret that signs deliveries to jobs' ``callback_url``."""
        return await self._run(_endpoints.callback_secret(self._ctx))

    async def rotate_callback_secret(self) -> SigningSecret:
        return await self._run(_endpoints.rotate_callback_secret(self._ctx))


class AsyncHeraldAdmin(_Driver):
    """The operator's asyncio client for the admin API (SPEC §12): the promises of
    ``HeraldAdmin``, as coroutines; listings are async iterators."""

    def __init__(self, url: str, admin_key: str, *, timeout: float = 10.0, policy: Policy = Policy(),
                 http: httpx.AsyncClient | None = None, rng: random.Random | None = None) -> None:
        super().__init__(url, admin_key, timeout=timeout, policy=policy, http=http, rng=rng)

    async def create_tenant(self, tenant: str, limits: LimitsArg | None = None) -> Tenant:
        return await self._run(_admin.create_tenant(tenant, limits, self._ctx))

    def list_tenants(self, *, page_size: int | None = None) -> AsyncIterator[Tenant]:
        return self._emitted(_admin.each(_admin.TENANTS, TenantList, page_size, self._ctx))

    async def get_tenant(self, tenant: Tenant | str) -> Tenant:
        return await self._run(_admin.get_tenant(tenant, self._ctx))

    async def update_tenant(self, tenant: Tenant | str, *, limits: LimitsArg | None = None,
                            disabled: bool | None = None) -> Tenant:
        return await self._run(_admin.update_tenant(tenant, limits, disabled, self._ctx))

    async def create_key(self, tenant: Tenant | str, name: str, *, scopes: Collection[str] | None = None,
                         expires_at: datetime | str | None = None) -> CreatedKey:
        return await self._run(_admin.create_key(tenant, name, scopes, expires_at, self._ctx))

    def list_keys(self, tenant: Tenant | str, *, page_size: int | None = None) -> AsyncIterator[ApiKey]:
        return self._emitted(_admin.each(_admin.keys_path(tenant), KeyList, page_size, self._ctx))

    async def revoke_key(self, key: ApiKey | str) -> None:
        await self._run(_admin.revoke_key(key, self._ctx))

    def audit(self, *, page_size: int | None = None) -> AsyncIterator[AuditEntry]:
        return self._emitted(_admin.each(_admin.AUDIT, AuditList, page_size, self._ctx))
