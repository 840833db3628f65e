"""The client's logic, written once, with no I/O (sans-IO).

Each operation is a *flow*: a generator that yields actions (``Call`` a request,
``Sleep``, ``Open`` a stream and ``Read`` from it, ``Save`` a body to a file, ``Emit`` a
value to the caller) and receives their outcomes (a ``Reply`` or a ``Failure``). The
sync and async clients are thin drivers that perform those actions with
``httpx.Client`` or ``httpx.AsyncClient``; every decision — what to retry, how long to
wait, when a job is done, how to resume a stream — is made here, once.
"""

from __future__ import annotations

import email.message
import os
import random
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from herald_client.errors import (
    HeraldConnectionError,
    JobNotSucceeded,
    ProtocolError,
    ProblemError,
    WaitTimeout,
    problem_class,
)
from herald_client.models import (
    Download,
    JobEvent,
    JobStatus,
    OutputChunk,
    Problem,
    Result,
    problem_decoder,
    status_decoder,
)
from herald_client.policy import Policy, parse_retry_after
from herald_client.sse import SSEDecoder

T = TypeVar("T")

# ----- actions and outcomes ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str  # path-absolute (``/jobs/…``, as the server writes every URL) or absolute
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: Mapping[str, str]  # lower-case names
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Failure:
    """The request may or may not have reached the server: no answer came back."""

    reason: str


@dataclass(frozen=True, slots=True)
class Saved:
    reply: Reply
    path: Path | None  # the temporary file holding a 2xx body, else None
    size: int = 0


@dataclass(frozen=True, slots=True)
class Call:
    """Send ``request``, read the whole answer: ``Reply`` or ``Failure``."""

    request: Request


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Open:
    """Send ``request`` and keep a 2xx body open for ``Read``; other answers are read whole.

    Opening again, or the flow ending, closes the previous one.
    """

    request: Request


@dataclass(frozen=True, slots=True)
class Read:
    """The next chunk of the open body: bytes, ``b""`` at its end, or ``Failure``."""


@dataclass(frozen=True, slots=True)
class Save:
    """Send ``request``; stream a 2xx body into a new temporary file in ``directory``."""

    request: Request
    directory: Path


@dataclass(frozen=True, slots=True)
class Emit:
    """Hand ``value`` to the caller (a stream's event, or a status update while waiting)."""

    value: Any


Action = Call | Sleep | Open | Read | Save | Emit
Outcome = Reply | Failure | Saved | bytes | None
Flow = Generator[Action, Any, T]


@dataclass(frozen=True, slots=True)
class Context:
    """What every flow needs besides its arguments: the policy, a clock and a random source."""

    policy: Policy = Policy()
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic


# ----- pure decisions -----------------------------------------------------------------------


def problem_from(reply: Reply) -> ProblemError:
    """The exception for a non-success answer, carrying its problem+json fields."""
    problem: Problem
    try:
        problem = problem_decoder.decode(reply.body) if reply.body else Problem()
    except msgspec.DecodeError:
        problem = Problem(detail=reply.body[:200].decode(errors="replace") or None)
    if not problem.title:
        problem = msgspec.structs.replace(problem, title=f"HTTP {reply.status}")
    return problem_class(reply.status)(
        problem,
        status=reply.status,
        retry_after=parse_retry_after(reply.headers.get("retry-after")),
        request_id=reply.headers.get("x-request-id"),
    )


def retry_delay(outcome: Reply | Failure, attempt: int, ctx: Context, *, replay_safe: bool,
                retry_conflict: bool = False) -> float | None:
    """Seconds to wait before sending the same request again, or None: this outcome is final.

    ``replay_safe``: sending the request twice cannot do the work twice (a GET, a DELETE,
    or a start carrying an Idempotency-Key). Only then is a lost answer (no reply, or a
    5xx that may have come after the work) retried. A 429 or 503 means the server did not
    take the request, so it is always retried, after its ``Retry-After`` when it gives one.
    """
    policy = ctx.policy
    backoff = policy.retry.delay(attempt, ctx.rng)
    if isinstance(outcome, Failure):
        return backoff if replay_safe else None
    if outcome.status in (429, 503):
        hinted = parse_retry_after(outcome.headers.get("retry-after"))
        return min(hinted, policy.max_retry_after) if hinted is not None else backoff
    if outcome.status >= 500:
        return backoff if replay_safe else None
    if outcome.status == 409 and retry_conflict:
        return backoff  # the same Idempotency-Key is still being processed
    return None


def next_poll_delay(reply: Reply, level: int, ctx: Context) -> tuple[float, int]:
    """How long to wait before polling a running job again, and the next backoff level.

    The server's ``Retry-After`` when it sends one; otherwise exponential backoff with
    jitter and a cap (``level`` counts the polls made without a hint).
    """
    hinted = parse_retry_after(reply.headers.get("retry-after"))
    if hinted is not None:
        return min(hinted, ctx.policy.max_retry_after), level
    return ctx.policy.poll.delay(level, ctx.rng), level + 1


def filename_from(headers: Mapping[str, str]) -> str | None:
    """The file name of ``Content-Disposition`` (RFC 6266, with RFC 2231 ``filename*``), made safe."""
    value = headers.get("content-disposition")
    if not value:
        return None
    message = email.message.Message()
    message["content-disposition"] = value
    name = message.get_filename()
    if not name:
        return None
    name = os.path.basename(name.replace("\\", "/")).strip()
    return name if name not in ("", ".", "..") else None


def decode_status(reply: Reply) -> JobStatus:
    return decode_status_json(reply.body)


def decode_status_json(data: bytes | str) -> JobStatus:
    try:
        return status_decoder.decode(data)
    except msgspec.DecodeError as exc:  # includes ValidationError
        raise ProtocolError(f"not a job status object: {exc}") from exc


def media_type(headers: Mapping[str, str]) -> str:
    return headers.get("content-type", "application/octet-stream").split(";")[0].strip()


# ----- flows ------------------------------------------------------------------------------


def call(request: Request, ctx: Context, *, replay_safe: bool, retry_conflict: bool = False) -> Flow[Reply]:
    """Send ``request`` until it gets a final answer (which may be an error answer)."""
    attempts = max(1, ctx.policy.attempts)
    for attempt in range(attempts):
        outcome: Reply | Failure = yield Call(request)
        delay = retry_delay(outcome, attempt, ctx, replay_safe=replay_safe, retry_conflict=retry_conflict)
        if delay is None or attempt == attempts - 1:
            break
        yield Sleep(delay)
    if isinstance(outcome, Failure):
        raise HeraldConnectionError(f"{request.method} {request.path}: {outcome.reason}", attempts=attempt + 1)
    return outcome


def submit(path: str, body: bytes, idempotency_key: str | None, ctx: Context) -> Flow[JobStatus]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    keyed = idempotency_key is not None
    reply = yield from call(Request("POST", path, headers, body), ctx, replay_safe=keyed, retry_conflict=keyed)
    if reply.status in (200, 201, 202):
        return decode_status(reply)
    raise problem_from(reply)


def status(job_id: str, ctx: Context) -> Flow[JobStatus]:
    reply = yield from _status_reply(job_id, ctx)
    return decode_status(reply)


def _status_reply(job_id: str, ctx: Context) -> Flow[Reply]:
    reply = yield from call(Request("GET", f"/jobs/{job_id}", {"Accept": "application/json"}), ctx, replay_safe=True)
    if reply.status in (200, 303):
        return reply
    raise problem_from(reply)


def cancel(job_id: str, ctx: Context) -> Flow[JobStatus]:
    reply = yield from call(Request("DELETE", f"/jobs/{job_id}", {"Accept": "application/json"}), ctx,
                            replay_safe=True)
    if reply.status in (200, 202):
        return decode_status(reply)
    raise problem_from(reply)


def wait(job_id: str, timeout: float | None, follow: bool, ctx: Context) -> Flow[JobStatus | Result]:
    """Poll until the job ends (or ``timeout`` seconds pass); emit each new version seen.

    Honours ``Retry-After``; without one, backs off exponentially with jitter up to a cap.
    A 429 or 503 slows the poller down; transport errors and other 5xx are retried up to
    the policy's attempts in a row. Ends with the terminal status, or with the result when
    ``follow`` (following the 303; a job that failed or was cancelled raises
    ``JobNotSucceeded``).
    """
    deadline = None if timeout is None else ctx.clock() + timeout
    last: JobStatus | None = None
    etag: str | None = None
    level = 0  # polls without a Retry-After hint
    failures = 0  # transport errors and 5xx in a row
    while True:
        headers = {"Accept": "application/json"}
        if etag is not None and last is not None:
            headers["If-None-Match"] = etag
        outcome = yield Call(Request("GET", f"/jobs/{job_id}", headers))
        if isinstance(outcome, Failure) or outcome.status >= 500 or outcome.status == 429:
            slow_down = isinstance(outcome, Reply) and outcome.status in (429, 503) and \
                "retry-after" in outcome.headers
            if not slow_down:
                failures += 1
            if failures >= ctx.policy.attempts:
                if isinstance(outcome, Failure):
                    raise HeraldConnectionError(f"GET /jobs/{job_id}: {outcome.reason}", attempts=failures)
                raise problem_from(outcome)
            delay = retry_delay(outcome, failures, ctx, replay_safe=True) or 0.0
            level += 1  # and come back more slowly afterwards too
        elif outcome.status == 304 and last is not None:
            failures = 0
            delay, level = next_poll_delay(outcome, level, ctx)
        elif outcome.status in (200, 303):
            failures = 0
            current = decode_status(outcome)
            etag = outcome.headers.get("etag")
            if last is None or current.version != last.version:
                yield Emit(current)
            last = current
            if current.terminal:
                if not follow:
                    return current
                if current.state != "succeeded":
                    raise JobNotSucceeded(current)
                location = outcome.headers.get("location") or current.result
                return (yield from _fetch_result(current, location, ctx))
            delay, level = next_poll_delay(outcome, level, ctx)
        else:
            raise problem_from(outcome)
        if deadline is not None:
            remaining = deadline - ctx.clock()
            if remaining <= 0:
                raise WaitTimeout(last, timeout or 0.0)
            delay = min(delay, remaining)
        yield Sleep(delay)


def _fetch_result(current: JobStatus, location: str | None, ctx: Context) -> Flow[Result]:
    if not location:
        raise JobNotSucceeded(current)
    reply = yield from call(Request("GET", location), ctx, replay_safe=True)
    if reply.status != 200:
        raise problem_from(reply)
    return Result(status=current, content=reply.body, media_type=media_type(reply.headers),
                  filename=filename_from(reply.headers))


def download(job_id: str, target: Path | None, ctx: Context) -> Flow[Download]:
    """Write a succeeded job's result to ``target`` (a file, or a directory to put it in).

    The body goes to a temporary file beside the target and is renamed into place only
    when complete, so a reader never sees half a result.
    """
    reply = yield from _status_reply(job_id, ctx)
    current = decode_status(reply)
    if current.state != "succeeded":
        raise JobNotSucceeded(current)
    location = reply.headers.get("location") or current.result
    if not location:
        raise JobNotSucceeded(current)
    if target is None or target.is_dir():
        directory, name = (target or Path.cwd()), None
    else:
        directory, name = target.parent, target.name
    attempts = ctx.policy.attempts
    for attempt in range(attempts):
        outcome = yield Save(Request("GET", location), directory)
        if isinstance(outcome, Saved) and outcome.reply.status == 200 and outcome.path is not None:
            final = directory / (name or filename_from(outcome.reply.headers) or f"{current.kind}-{current.id}")
            os.replace(outcome.path, final)
            return Download(status=current, path=final, media_type=media_type(outcome.reply.headers),
                            size=outcome.size)
        answer = outcome.reply if isinstance(outcome, Saved) else outcome
        delay = retry_delay(answer, attempt, ctx, replay_safe=True)
        if delay is None or attempt == attempts - 1:
            if isinstance(answer, Failure):
                raise HeraldConnectionError(f"GET {location}: {answer.reason}", attempts=attempt + 1)
            raise problem_from(answer)
        yield Sleep(delay)
    raise AssertionError("unreachable")


def stream(job_id: str, last_event_id: str | None, ctx: Context) -> Flow[None]:
    """Emit the job's events (``JobEvent``) until its terminal one, resuming after drops.

    A dropped connection is reopened after the server's ``retry:`` time (backing off when
    it keeps failing) with ``Last-Event-ID``, so nothing is missed; an event whose version
    was already emitted is skipped, so nothing is seen twice. ``204`` means the stream is
    over (the resume point was already the terminal event).
    """
    last_version = int(last_event_id) if last_event_id is not None and last_event_id.isascii() and last_event_id.isdigit() else -1
    retry_s: float | None = None
    failures = 0
    while True:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        outcome = yield Open(Request("GET", f"/jobs/{job_id}/events", headers))
        if isinstance(outcome, Reply) and outcome.status == 204:
            return
        if isinstance(outcome, Reply) and outcome.status == 200:
            decoder = SSEDecoder()
            progressed = False
            while True:
                chunk = yield Read()
                if isinstance(chunk, Failure) or not chunk:
                    break
                for message in decoder.feed(chunk):
                    progressed = True
                    if message.id is not None:
                        last_event_id = message.id
                    current = decode_status_json(message.data)
                    if current.version > last_version:
                        last_version = current.version
                        yield Emit(JobEvent(id=message.id, type=message.event, data=current))
                    if current.terminal:
                        return
                if decoder.retry_ms is not None:
                    retry_s = decoder.retry_ms / 1000
            if progressed:  # a drop after progress: reconnect after the server's retry time
                failures = 0
                delay = retry_s if retry_s is not None else ctx.policy.retry.initial
            else:
                failures += 1
                delay = max(retry_s or 0.0, ctx.policy.retry.delay(failures - 1, ctx.rng))
        else:
            failures += 1
            hinted = retry_delay(outcome, failures, ctx, replay_safe=True)
            if hinted is None:
                assert isinstance(outcome, Reply)  # a Failure always gets a delay
                raise problem_from(outcome)
            delay = max(hinted, retry_s or 0.0)
        if failures >= ctx.policy.attempts:
            if isinstance(outcome, Reply) and outcome.status != 200:
                raise problem_from(outcome)
            reason = outcome.reason if isinstance(outcome, Failure) else "the stream kept ending early"
            raise HeraldConnectionError(f"GET /jobs/{job_id}/events: {reason}", attempts=failures)
        yield Sleep(delay)


def output(job_id: str, after: int | None, ctx: Context) -> Flow[JobStatus | None]:
    """Emit the job's output chunks (``OutputChunk``) live until the job has ended, resuming
    after drops; return the job's final status (None when the server answered 204: the
    resume point was already its last chunk of a finished job).

    A dropped connection is reopened after the server's ``retry:`` time with
    ``Last-Event-ID`` = the last chunk's number, so nothing is missed; a chunk whose number
    was already emitted is skipped, so nothing is seen twice.
    """
    last = after or 0
    retry_s: float | None = None
    failures = 0
    while True:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
        if last:
            headers["Last-Event-ID"] = str(last)
        outcome = yield Open(Request("GET", f"/jobs/{job_id}/output", headers))
        if isinstance(outcome, Reply) and outcome.status == 204:
            return None
        if isinstance(outcome, Reply) and outcome.status == 200:
            decoder = SSEDecoder()
            progressed = False
            while True:
                chunk = yield Read()
                if isinstance(chunk, Failure) or not chunk:
                    break
                for message in decoder.feed(chunk):
                    progressed = True
                    if message.event != "output":
                        return decode_status_json(message.data)  # the terminal event: the job ended
                    n = int(message.id) if message.id is not None and message.id.isdigit() else 0
                    if n > last:
                        last = n
                        try:
                            data = msgspec.json.decode(message.data)
                        except msgspec.DecodeError as exc:
                            raise ProtocolError(f"an output chunk is not JSON: {exc}") from exc
                        yield Emit(OutputChunk(n=n, data=data))
                if decoder.retry_ms is not None:
                    retry_s = decoder.retry_ms / 1000
            if progressed:
                failures = 0
                delay = retry_s if retry_s is not None else ctx.policy.retry.initial
            else:
                failures += 1
                delay = max(retry_s or 0.0, ctx.policy.retry.delay(failures - 1, ctx.rng))
        else:
            failures += 1
            hinted = retry_delay(outcome, failures, ctx, replay_safe=True)
            if hinted is None:
                assert isinstance(outcome, Reply)
                raise problem_from(outcome)
            delay = max(hinted, retry_s or 0.0)
        if failures >= ctx.policy.attempts:
            if isinstance(outcome, Reply) and outcome.status != 200:
                raise problem_from(outcome)
            reason = outcome.reason if isinstance(outcome, Failure) else "the stream kept ending early"
            raise HeraldConnectionError(f"GET /jobs/{job_id}/output: {reason}", attempts=failures)
        yield Sleep(delay)


# ----- webhooks: plain JSON calls ------------------------------------------------------------


def _json_reply(method: str, path: str, body: Any, ctx: Context, *, replay_safe: bool) -> Flow[Reply]:
    """One JSON request, retried only when ``replay_safe`` (sending it twice does no harm:
    reads, PATCH, DELETE); a create, a rotation or a test event is sent once."""
    headers = {"Accept": "application/json"}
    content = None
    if body is not None:
        headers["Content-Type"] = "application/json"
        content = msgspec.json.encode(body)
    reply = yield from call(Request(method, path, headers, content), ctx, replay_safe=replay_safe)
    if not 200 <= reply.status < 300:
        raise problem_from(reply)
    return reply


def json_call(method: str, path: str, body: Any, result: type[T], ctx: Context, *, replay_safe: bool) -> Flow[T]:
    """One JSON request; the answer decoded as ``result``."""
    reply = yield from _json_reply(method, path, body, ctx, replay_safe=replay_safe)
    try:
        return msgspec.json.decode(reply.body, type=result)
    except msgspec.DecodeError as exc:  # includes ValidationError
        raise ProtocolError(f"{method} {path}: not a {result.__name__}: {exc}") from exc


def empty_call(method: str, path: str, ctx: Context, *, replay_safe: bool) -> Flow[None]:
    """One request whose answer has no body worth reading (``204``)."""
    yield from _json_reply(method, path, None, ctx, replay_safe=replay_safe)
