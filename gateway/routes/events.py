"""Server-sent events and the JSON event feed (SPEC §8).

Every stream registers with the hub *before* it reads the store, so a transition that
commits while the client (re)connects is either in the history it reads or in its queue;
version (per job) and tenant sequence numbers make the overlap harmless: nothing is
missed and nothing is sent twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any
from urllib.parse import quote

from litestar import Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.params import FromPath, QueryParameter

from gateway.auth import bearer_tenant, held_for_owner, note_stream_owner, require_tenant
from herald.tenants import SCOPE_JOBS_READ
from gateway.cursors import MAX_SEQ
from gateway.ids import kind_filter
from gateway.hub import RESYNC
from gateway.openapi import problems
from gateway.problems import EVENT_STREAM_OPT, InvalidRequest, InvalidSignature, Unauthorized
from gateway.render import EVENTS_PURPOSE, NO_STORE
from gateway.routes.jobs import find_job, find_signed_job
from gateway.services import Services, services
from gateway.sse import RETRY_FRAME, Dropped, EventStream, drop_handle, job_frame, tenant_frame
from herald.jobs import JobRow
from schemas import FieldError
from schemas.events import EventFeed, EventLink, FeedEvent
from schemas.jobs import TERMINAL_EVENT_TYPES

TENANT_EVENTS_PURPOSE = "tenant-events"
MAX_CURSOR_LENGTH = 20


def _parse_cursor(raw: str | None, what: str) -> int | None:
    """A resume point: a non-negative integer this server gave out, else None (no replay)."""
    if raw is None or raw == "":
        return None
    if len(raw) > MAX_CURSOR_LENGTH or not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_SEQ:
        raise ValueError(f"{what} must be an event id this server gave out")
    return int(raw)


UNREPLAYABLE = -1  # a resume point that is no event id we gave out: answered with a job.snapshot


def _resume_point(request: Request, query_value: str | None) -> int | None:
    """None: a fresh stream. An int: resume after it (``UNREPLAYABLE`` for ids we never gave out)."""
    # The header wins: a browser keeps the query string on every reconnect.
    sent = request.headers.getall("last-event-id", [])
    if len(sent) > 1:
        return UNREPLAYABLE  # which one is the resume point cannot be told
    header = sent[0] if sent else None
    try:
        return _parse_cursor(header if header is not None else query_value, "Last-Event-ID")
    except ValueError:
        return UNREPLAYABLE


# ----- one job's stream ------------------------------------------------------------------


async def _job_for_stream(request: Request, svc: Services, job_id: str, exp: str | None, sig: str | None) -> JobRow:
    if exp is not None or sig is not None:
        if not svc.signer.verify(request.url.path, EVENTS_PURPOSE, exp, sig):
            raise InvalidSignature("this signed stream URL is not valid; take links.events from a fresh status")
        job = await find_signed_job(svc, job_id)
        note_stream_owner(request, svc, job.tenant)
        return job
    tenant = bearer_tenant(request, svc, SCOPE_JOBS_READ)
    if tenant is None:
        raise Unauthorized("send Authorization: Bearer <key> or use the signed links.events URL")
    return await find_job(svc, tenant, job_id)


async def _job_opening(svc: Services, job_id: str, resume: int | None) -> tuple[list[bytes], int, bool] | None:
    """What a job's stream sends first (replay or snapshot), the version it is at and whether
    it has ended; None when the job is gone. A function of its own, so that the rows it reads
    are not kept alive in the frame of a stream that then idles for minutes."""
    history = await svc.store.job_events(job_id, resume) if resume is not None and resume >= 0 else []
    current = await svc.store.get(job_id)
    if current is None:
        return None
    if resume is not None and history and history[0].version == resume + 1:
        last = history[-1].version
        return [job_frame(event) for event in history], last, history[-1].type in TERMINAL_EVENT_TYPES
    if resume is not None and resume == current.version:
        return [], resume, current.terminal
    frames = []
    snapshot = await svc.store.job_events(current.id, current.version - 1, limit=1)
    if snapshot and snapshot[0].version == current.version:
        # A fresh stream names the snapshot by the change that made it; a resume
        # point we cannot replay from is answered with a plain snapshot.
        frames.append(job_frame(snapshot[0], None if resume is None else "job.snapshot"))
    return frames, current.version, current.terminal


async def _job_stream(svc: Services, job_id: str, resume: int | None) -> AsyncIterator[bytes]:
    """The stream's body (its response holds the tenant's held-stream slot: ``EventStream``)."""
    subscriber = svc.hub.subscribe_job(job_id)
    subscriber.on_drop = drop_handle()
    svc.metrics.sse_streams.inc()
    try:
        yield RETRY_FRAME
        opening = await _job_opening(svc, job_id, resume)
        if opening is None:
            return
        frames, last, ended = opening
        del opening
        while frames:  # popped, so that an idle stream keeps no snapshot frame of its own
            yield frames.pop(0)
        del frames
        while not ended:
            while not subscriber.items:
                await subscriber.wait()
            item = subscriber.items.pop(0)
            if isinstance(item, bytes):
                yield item  # the hub's keep-alive
                continue
            if subscriber.overflowed:
                raise Dropped  # a slow consumer (counted); it resumes with Last-Event-ID
            if item is RESYNC or item.event.version > last + 1:
                svc.metrics.sse_gap_reads.labels(stream="job").inc()
                batch = await svc.store.job_events(job_id, last)
            elif item.event.version == last + 1:
                yield item.frame  # built once by the hub for every stream of this job
                subscriber.sent()
                last, ended = item.event.version, item.event.type in TERMINAL_EVENT_TYPES
                continue
            else:
                continue  # already sent (history overlap or a duplicate publish)
            for event in batch:
                yield job_frame(event)
                subscriber.sent()
                last, ended = event.version, event.type in TERMINAL_EVENT_TYPES
    finally:
        svc.metrics.sse_streams.dec()
        svc.hub.unsubscribe(subscriber)


@get("/jobs/{job_id:str}/events", operation_id="job_events", tags=["events"],
     summary="Server-sent events of one job", media_type="text/event-stream", opt={EVENT_STREAM_OPT: True},
     responses={
         204: ResponseSpec(None, description="Finished stream resumed at its terminal event: stop reconnecting"),
         **problems(400, 401, 403, 404, 410, 429),
     })
async def job_events(
    request: Request,
    job_id: FromPath[str],
    last_event_id: Annotated[str | None, QueryParameter(name="last_event_id", max_length=MAX_CURSOR_LENGTH)] = None,
    exp: Annotated[str | None, QueryParameter(name="exp", max_length=12)] = None,
    sig: Annotated[str | None, QueryParameter(name="sig", max_length=100)] = None,
) -> Any:
    """`retry:`, the current status, then every committed change (`id:` = version) until the terminal one."""
    svc = services(request)
    job = await _job_for_stream(request, svc, job_id, exp, sig)
    resume = _resume_point(request, last_event_id)
    if job.terminal and resume == job.version:
        return Response(None, status_code=204, headers={"Cache-Control": "no-store"})
    return EventStream(_job_stream(svc, job.id, resume), slot=svc.limiter.stream_slot(job.tenant))


# ----- the tenant's stream and feed ------------------------------------------------------


def _tenant_for_feed(request: Request, svc: Services, exp: str | None, sig: str | None, tenant: str | None) -> str:
    if sig is not None or exp is not None:
        tenant = tenant or ""
        if len(tenant) > 64 or not svc.signer.verify("/events", TENANT_EVENTS_PURPOSE, exp, sig, extra=tenant):
            raise InvalidSignature("this signed stream URL is not valid; ask POST /events/link for a fresh one")
        note_stream_owner(request, svc, tenant)
        return tenant
    return require_tenant(request, svc, SCOPE_JOBS_READ)


async def _tenant_stream(svc: Services, tenant: str, kind: str | None, resume: int | None) -> AsyncIterator[bytes]:
    """The stream's body (its response holds the tenant's held-stream slot: ``EventStream``)."""
    subscriber = svc.hub.subscribe_tenant(tenant)
    subscriber.on_drop = drop_handle()
    svc.metrics.sse_streams.inc()
    try:
        yield RETRY_FRAME
        last = await svc.store.last_event_seq(tenant)
        if resume is not None and resume < last:
            while True:  # replay in pages: a long absence must not load everything at once
                page = await svc.store.tenant_events(tenant, resume, 500)
                for event in page:
                    if kind is None or event.kind == kind:
                        yield tenant_frame(event)
                    resume = event.seq
                if len(page) < 500:
                    break
            last = max(last, resume)
        while True:
            while not subscriber.items:
                await subscriber.wait()
            # Everything queued since the stream last woke goes out as one send: a busy
            # tenant's events arrive in bursts, and a send per event was a write per event.
            taken, subscriber.items = subscriber.items, []
            frames: list[bytes] = []
            gap = False
            for n, item in enumerate(taken):
                if isinstance(item, bytes):
                    frames.append(item)  # the hub's keep-alive
                elif subscriber.overflowed:
                    raise Dropped  # a slow consumer (counted); it resumes with Last-Event-ID
                elif item is RESYNC or item.event.seq > last + 1:
                    gap = True
                    subscriber.items[:0] = taken[n + 1:]  # after the read: copies then, or further on
                    break
                elif item.event.seq == last + 1:
                    if kind is None or item.event.kind == kind:
                        frames.append(item.frame)  # built once by the hub for every stream of this tenant
                    last = item.event.seq
            del taken
            if gap:
                svc.metrics.sse_gap_reads.labels(stream="tenant").inc()
                batch = await svc.store.tenant_events(tenant, last, 10_000)
                frames.extend(tenant_frame(event) for event in batch if kind is None or event.kind == kind)
                if batch:
                    last = batch[-1].seq
                del batch
            if frames:
                yield b"".join(frames)
                subscriber.sent()  # events of other kinds than ?kind= are not: the keep-alive judges by this
            del frames
    finally:
        svc.metrics.sse_streams.dec()
        svc.hub.unsubscribe(subscriber)


async def _feed(
    request: Request, svc: Services, tenant: str, kind: str | None, after: str | None, limit: int, wait: int | None
) -> EventFeed:
    try:
        cursor = _parse_cursor(after, "after")
    except ValueError as exc:
        raise InvalidRequest([FieldError(field="after", message=str(exc))]) from exc
    position = cursor or 0
    events = await svc.store.tenant_events(tenant, position, limit, kind)
    if not events and position > 0 and position > await svc.store.last_event_seq(tenant):
        # No event of this tenant has been given that number: answered with it as the next
        # cursor, a client would skip every event numbered up to it.
        raise InvalidRequest([FieldError(field="after", message="is past the newest event: use a cursor this feed gave")])
    if not events and wait is not None:
        # A held feed poll holds a connection like a stream: it counts against max_streams (SPEC §13).
        svc.limiter.open_stream(tenant)
        subscriber = svc.hub.subscribe_tenant(tenant)
        svc.metrics.long_polls.inc()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait
            # 401 once the key (or a signed link's tenant) no longer holds, as a held stream ends.
            async with held_for_owner(request):
                events = await svc.store.tenant_events(tenant, position, limit, kind)  # after subscribing
                while not events and (remaining := deadline - loop.time()) > 0:
                    try:
                        async with asyncio.timeout(remaining):
                            await subscriber.next()
                    except TimeoutError:
                        break
                    events = await svc.store.tenant_events(tenant, position, limit, kind)
        finally:
            svc.metrics.long_polls.dec()
            svc.hub.unsubscribe(subscriber)
            svc.limiter.close_stream(tenant)
    next_cursor = str(events[-1].seq) if events else str(position)
    return EventFeed(
        events=[FeedEvent(id=str(e.seq), type=e.type, data=e.data) for e in events],
        next_cursor=next_cursor,
    )


def _wants_json(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/event-stream" not in accept


@get("/events", operation_id="tenant_events", tags=["events"],
     summary="The tenant's committed events: SSE, or a JSON page with Accept: application/json",
     opt={EVENT_STREAM_OPT: lambda request: not _wants_json(request)},
     responses={
         200: ResponseSpec(EventFeed, description="With Accept: application/json, a page of events; "
                           "otherwise a text/event-stream", generate_examples=False),
         **problems(400, 401, 403, 429),
     })
async def tenant_events(
    request: Request,
    kind: Annotated[str | None, QueryParameter(name="kind", max_length=64)] = None,
    after: Annotated[str | None, QueryParameter(name="after", max_length=MAX_CURSOR_LENGTH)] = None,
    limit: Annotated[int, QueryParameter(name="limit", ge=1, le=500)] = 100,
    wait: Annotated[int | None, QueryParameter(name="wait", ge=1, le=60)] = None,
    last_event_id: Annotated[str | None, QueryParameter(name="last_event_id", max_length=MAX_CURSOR_LENGTH)] = None,
    exp: Annotated[str | None, QueryParameter(name="exp", description="of a signed URL from POST /events/link")] = None,
    sig: Annotated[str | None, QueryParameter(name="sig", description="of a signed URL from POST /events/link")] = None,
    signed_tenant: Annotated[str | None, QueryParameter(name="tenant",
                                                   description="of a signed URL from POST /events/link")] = None,
) -> Any:
    svc = services(request)
    tenant = _tenant_for_feed(request, svc, exp, sig, signed_tenant)
    kind = kind_filter(kind)
    if _wants_json(request):
        feed = await _feed(request, svc, tenant, kind, after, limit, wait)
        return Response(feed, headers={"Cache-Control": "no-store"})
    resume = _resume_point(request, last_event_id)
    if resume == UNREPLAYABLE:
        resume = None  # the tenant stream sends no snapshot: it goes live from now
    return EventStream(_tenant_stream(svc, tenant, kind, resume), slot=svc.limiter.stream_slot(tenant))


@post("/events/link", operation_id="events_link", tags=["events"], status_code=200,
      summary="A signed URL for the tenant's event stream (for EventSource, which cannot send a key)",
      responses=problems(401), cache_control=NO_STORE)
async def events_link(request: Request) -> EventLink:
    svc = services(request)
    tenant = require_tenant(request, svc, SCOPE_JOBS_READ)
    url = svc.signer.sign("/events", TENANT_EVENTS_PURPOSE, extra=tenant)
    return EventLink(url=f"{url}&tenant={quote(tenant, safe='')}", expires_in=int(svc.settings.signed_url_ttl_s))

