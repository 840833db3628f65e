"""A job's streamed output, ``GET /jobs/{id}/output`` (SPEC §8): SSE, or NDJSON by ``Accept``.

Chunks are kept in JetStream (``herald.output``); live ones reach this gateway through the
hub's one subscription to what JetStream republishes once stored. A stream registers with
the hub **before** it replays from JetStream, then sends each chunk once, in order of its
number: a live chunk at ``last + 1`` is sent as it is, an older one is a copy, one further
ahead means a gap (a lost core message) and is filled by replaying from the stream position
of the last chunk sent. The worker stores every chunk before it records the job's end, so
once the terminal event arrives one more replay finds every chunk, and the stream ends with
that event. Its ``id:`` is the number of the last chunk (0 when there was none), so a
browser's reconnect carries a Last-Event-ID at the end, which is answered 204 and stops its
EventSource: without one (a job with no chunks) it reconnected from the start for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, get
from litestar.openapi import ResponseSpec
from litestar.params import FromPath, QueryParameter
from litestar.response import Stream
from nats.js import JetStreamContext

from gateway.auth import bearer_tenant, note_stream_owner
from gateway.hub import RESYNC, Framed, LiveChunk
from gateway.openapi import problems
from gateway.problems import EVENT_STREAM_OPT, InvalidRequest, InvalidSignature, Unauthorized, Unavailable
from gateway.render import OUTPUT_PURPOSE
from gateway.routes.events import MAX_CURSOR_LENGTH
from gateway.routes.jobs import find_job, find_signed_job
from gateway.services import Services, services
from gateway.headers import connection_abort
from gateway.sse import ABORT_WAIT_S, RETRY_FRAME, Dropped, EventStream, drop_handle, frame
from herald.jobs import JobRow
from herald.output import MAX_UNSTORED, UNREACHABLE, Chunk, last_mark, replay
from herald.tenants import SCOPE_JOBS_READ
from schemas import FieldError

NDJSON = "application/x-ndjson"
_UNREACHABLE_DETAIL = "the output store (NATS) is not reachable from this gateway; retry shortly"

log = logging.getLogger("herald.output")


class _Line(msgspec.Struct):
    n: int
    data: msgspec.Raw


_encoder = msgspec.json.Encoder()


class _NdjsonStream(Stream):
    """A stream sent as ``application/x-ndjson`` (the route's declared media type is SSE's)."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = NDJSON
        return super().to_asgi_response(*args, **kwargs)


def _chunk_frame(chunk: Chunk) -> bytes:
    return frame(str(chunk.n), "output", chunk.data)


def _position(raw: str | None, field: str) -> int | None:
    if raw is None or raw == "":
        return None
    if len(raw) > MAX_CURSOR_LENGTH or not raw.isascii() or not raw.isdigit():
        raise InvalidRequest([FieldError(field=field, message="must be a chunk number (a non-negative integer)")])
    return int(raw)


async def _job_for_output(request: Request, svc: Services, job_id: str, exp: str | None, sig: str | None) -> JobRow:
    if exp is not None or sig is not None:
        if not svc.signer.verify(request.url.path, OUTPUT_PURPOSE, exp, sig):
            raise InvalidSignature("this signed output URL is not valid; take links.output from a fresh status")
        job = await find_signed_job(svc, job_id)
        note_stream_owner(request, svc, job.tenant)
        return job
    tenant = bearer_tenant(request, svc, SCOPE_JOBS_READ)
    if tenant is None:
        raise Unauthorized("send Authorization: Bearer <key> or use the signed links.output URL")
    return await find_job(svc, tenant, job_id)


def _jetstream(svc: Services) -> JetStreamContext | None:
    nc = svc.nats
    return nc.jetstream() if nc is not None and nc.is_connected else None


async def _catch_up(js: JetStreamContext, job: JobRow, last: int, seq: int, held: dict[int, Chunk] | None = None,
                    *, final: bool) -> AsyncGenerator[Chunk, None]:
    """The stored chunks after number ``last``, in number order, read from stream position
    ``seq`` on. A chunk stored out of order (a writer resends from its first unacknowledged
    chunk, so a partial failure can store 3 before 2) is held until the ones before it come:
    in ``held``, which a live stream keeps from one catch-up to the next. Only once the job has
    ended (``final``: every chunk it will have is stored) is what is still held sent, in
    number order; before, a chunk sent past a gap made the one that filled it look a copy.
    So is what is held once it is ``MAX_UNSTORED`` chunks: no resend fills a gap that wide
    (the run that left it is gone, and a re-run numbers after it), and the hold is bounded."""
    mark = await last_mark(js, job.tenant, job.id)
    held = {} if held is None else held
    async for chunk in replay(js, job.tenant, job.id, seq, mark.seq):
        if chunk.n <= last or chunk.n in held:
            continue
        held[chunk.n] = chunk
        while last + 1 in held:
            ready = held.pop(last + 1)
            last = ready.n
            yield ready
    if final or len(held) >= MAX_UNSTORED:
        for n in sorted(held):
            yield held.pop(n)


async def _terminal_frame(svc: Services, job_id: str) -> bytes | None:
    current = await svc.store.get(job_id)
    if current is None or not current.terminal:
        return None
    events = await svc.store.job_events(job_id, current.version - 1, limit=1)
    if not events:
        return None
    return frame(None, events[0].type, bytes(events[0].data))


async def _output_stream(svc: Services, js: JetStreamContext, job: JobRow, resume: int) -> AsyncIterator[bytes]:
    """The SSE body (its response holds the tenant's held-stream slot: ``EventStream``)."""
    subscriber = svc.hub.subscribe_output(job.id)
    subscriber.on_drop = drop_handle()
    svc.metrics.sse_streams.inc()
    last, seq = resume, 0
    ended: bytes | None = None
    held: dict[int, Chunk] = {}  # read past a gap, waiting for the chunks before them (``_catch_up``)

    async def catch_up() -> AsyncIterator[bytes]:
        """The chunks after ``last`` from JetStream; again while what the hub heard meanwhile
        did not fit in the stream's queue (``OutputSubscriber.missed``), the end included."""
        nonlocal last, seq, ended
        subscriber.replaying = True
        try:
            while True:
                async for chunk in _catch_up(js, job, last, seq, held, final=ended is not None):
                    yield _chunk_frame(chunk)
                    subscriber.sent()
                    last, seq = chunk.n, max(seq, chunk.seq)
                if not subscriber.missed:
                    return
                subscriber.missed = False
                if ended is None:  # read before the replay, as at the start: a later end is heard
                    ended = await _terminal_frame(svc, job.id)
        finally:
            subscriber.replaying = False

    try:
        yield RETRY_FRAME
        try:
            ended = await _terminal_frame(svc, job.id)  # read after subscribing: a later end is heard
            async for data in catch_up():
                yield data
            while ended is None:
                while not subscriber.items:
                    await subscriber.wait()
                item = subscriber.items.pop(0)
                if isinstance(item, bytes):
                    yield item  # the hub's keep-alive
                    continue
                if subscriber.overflowed:
                    raise Dropped  # a slow reader (counted); it resumes with Last-Event-ID
                if isinstance(item, LiveChunk):
                    if item.n <= last:
                        continue  # already sent (replay overlap, or a copy)
                    if item.n == last + 1:
                        yield item.frame  # built once by the hub for every reader of this job
                        subscriber.sent()
                        last, seq = item.n, max(seq, item.seq)
                        held.pop(last, None)
                        while last + 1 in held:  # the gap it filled
                            chunk = held.pop(last + 1)
                            yield _chunk_frame(chunk)
                            last, seq = chunk.n, max(seq, chunk.seq)
                        continue
                elif isinstance(item, Framed):
                    ended = item.frame
                elif item is RESYNC:
                    ended = await _terminal_frame(svc, job.id)
                if ended is not None:
                    # The end can overtake a backlog of live chunks: the rest comes from JetStream,
                    # so this stream leaves the hub now (live chunks piling up meanwhile would
                    # overflow its queue and count it as a slow reader dropped).
                    svc.hub.unsubscribe(subscriber)
                async for data in catch_up():  # a gap, a reconnect, or the end
                    yield data
            # The terminal event's id: resuming after it is resuming at the end (204).
            yield b"id: %d\n" % last + ended
        except UNREACHABLE as exc:
            # NATS does not answer (down, or hung): end cleanly, and the client reconnects in
            # 3 s after the last chunk it got; never an unhandled error from a stream.
            log.warning("output stream ended: NATS did not answer", extra={"job_id": job.id, "error": repr(exc)})
    finally:
        svc.metrics.sse_streams.dec()
        svc.hub.unsubscribe(subscriber)


def _line(chunk: Chunk) -> bytes:
    return _encoder.encode(_Line(chunk.n, msgspec.Raw(chunk.data))) + b"\n"


async def _ndjson(job: JobRow, first: Chunk | None, rest: AsyncGenerator[Chunk, None],
                  abort: Callable[[], None] | None) -> AsyncIterator[bytes]:
    """The NDJSON body: ``first``, read before the answer started (``job_output``), then the
    rest. Should NATS stop answering now, the connection is reset: a body that simply ended
    would look complete to the client, one cut short is one it knows to ask again for
    (``?after=`` its last line)."""
    try:
        if first is None:
            return
        yield _line(first)
        async for chunk in rest:
            yield _line(chunk)
    except UNREACHABLE as exc:
        log.warning("output download cut short: NATS stopped answering", extra={"job_id": job.id, "error": repr(exc)})
        if abort is None:
            raise
        abort()
        await asyncio.sleep(ABORT_WAIT_S)  # cut short by the server, once it has seen the connection go
        raise
    finally:
        await rest.aclose()  # its replay's consumer, now (a HEAD, a client gone)


async def _retry_later() -> AsyncIterator[bytes]:
    """NATS is not reachable from this gateway right now: the browser reconnects in 3 s
    (an SSE request is never answered 5xx for what a client can outwait)."""
    yield RETRY_FRAME


def _wants_sse(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


@get("/jobs/{job_id:str}/output", operation_id="job_output", tags=["events"],
     summary="A job's streamed output: SSE (Accept: text/event-stream), else NDJSON", opt={EVENT_STREAM_OPT: _wants_sse},
     responses={
         200: ResponseSpec(None, description="The job's output chunks", generate_examples=False),
         204: ResponseSpec(None, description="Finished job resumed at its last chunk: stop reconnecting"),
         **problems(400, 401, 403, 404, 410, 429, 503),
     })
async def job_output(
    request: Request,
    job_id: FromPath[str],
    last_event_id: Annotated[str | None, QueryParameter(name="last_event_id", max_length=MAX_CURSOR_LENGTH,
                                                   description="SSE: only the chunks after this number")] = None,
    after: Annotated[str | None, QueryParameter(name="after", max_length=MAX_CURSOR_LENGTH,
                                           description="NDJSON: only the chunks after this number")] = None,
    exp: Annotated[str | None, QueryParameter(name="exp", max_length=12)] = None,
    sig: Annotated[str | None, QueryParameter(name="sig", max_length=100)] = None,
) -> Any:
    """Chunks as `id: <n>`, `event: output` (SSE, live, ending with the terminal event), or
    `{"n", "data"}` lines of the chunks so far (NDJSON)."""
    svc = services(request)
    job = await _job_for_output(request, svc, job_id, exp, sig)
    js = _jetstream(svc)
    if not _wants_sse(request):
        start = _position(after, "after") or 0
        if js is None:
            raise Unavailable(_UNREACHABLE_DETAIL, retry_after=1)
        chunks = _catch_up(js, job, start, 0, final=job.terminal)  # running: "so far" stops at a gap
        try:
            # What can fail is read before the answer starts (the job's last chunk, the
            # replay's consumer and its first chunk): NATS not answering is a 503 then, not a
            # 200 cut off after the request's timeout.
            first = await anext(chunks, None)
        except UNREACHABLE as exc:
            log.warning("output not read: NATS did not answer", extra={"job_id": job.id, "error": repr(exc)})
            raise Unavailable(_UNREACHABLE_DETAIL, retry_after=1) from None
        return _NdjsonStream(_ndjson(job, first, chunks, connection_abort(request.scope)),
                             headers={"Cache-Control": "no-store"})
    # The header wins: a browser keeps the query string on every reconnect.
    sent = request.headers.getall("last-event-id", [])
    if len(sent) > 1:
        raise InvalidRequest([FieldError(field="Last-Event-ID", message="sent more than once: send it once")])
    header = sent[0] if sent else None
    resume = _position(header, "Last-Event-ID") if header is not None else _position(last_event_id, "last_event_id")
    if js is None:
        return EventStream(_retry_later())
    if resume is not None and job.terminal:
        try:
            at_end = resume >= (await last_mark(js, job.tenant, job.id)).n
        except UNREACHABLE as exc:
            log.warning("output not read: NATS did not answer", extra={"job_id": job.id, "error": repr(exc)})
            return EventStream(_retry_later())
        if at_end:
            return Response(None, status_code=204, headers={"Cache-Control": "no-store"})
    return EventStream(_output_stream(svc, js, job, resume or 0), slot=svc.limiter.stream_slot(job.tenant))
