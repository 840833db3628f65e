"""The status answer (``GET /jobs/{id}``) built once and shared by every long poll one change wakes.

A thousand polls held on one job are woken by one committed transition. Each used to read
the row, sign its links and encode the status on its own: ~1 000 identical reads, HMACs and
encodings on one event loop, the last poll answered long after the first. Here the woken
polls of one job share one store read (one in-flight read, however many wait on it) and one
answer (status code, headers, encoded body) per job version, link expiry and Retry-After.

An answer is byte-identical to what a single poll at the same instant returns: the signed
links depend only on the path, the purpose and their ``exp`` (whole seconds, see
``UrlSigner.expiry``), and ``Retry-After`` is checked for each poll, so an answer is rebuilt
as soon as either would differ. Plain polls build their answer the same way
(``status_answer``), so the two cannot drift apart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from gateway.render import etag, public_status, retry_after
from herald.jobs import JobRow
from herald.signing import UrlSigner
from herald.storage.ports import JobStore
from schemas.jobs import QueuedReason

_encoder = msgspec.json.Encoder()  # what Litestar's JSON rendering of a Struct gives, byte for byte


@dataclass(frozen=True, slots=True)
class StatusAnswer:
    job: JobRow
    expiry: int  # the ``exp`` of its signed links
    retry_after: int | None  # None for a terminal job (no Retry-After header)
    status_code: int  # 200, or 303 once succeeded
    tag: str
    headers: dict[str, str]  # never mutated: Litestar copies a response's headers
    body: bytes


def status_answer(
    job: JobRow, signer: UrlSigner, at: float | None = None, queued_reason: QueuedReason | None = None
) -> StatusAnswer:
    """The answer to a poll of ``job`` at the instant ``at`` (default: now), headers and body."""
    at = time.time() if at is None else at
    tag = etag(job)
    body = _encoder.encode(public_status(job, signer, now=at, queued_reason=queued_reason))
    if job.state == "succeeded":
        return StatusAnswer(job, signer.expiry(at), None, 303, tag,
                            {"Location": job.result_url, "ETag": tag, "Cache-Control": "no-store"}, body)
    headers = {"ETag": tag, "Cache-Control": "no-store"}
    wait = None
    if not job.terminal:
        wait = retry_after(job, at)
        headers["Retry-After"] = str(wait)
    return StatusAnswer(job, signer.expiry(at), wait, 200, tag, headers, body)


class WokenAnswers:
    """The latest answer per job, for long polls woken by a change (see the module docstring)."""

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._answers: dict[str, StatusAnswer] = {}
        self._reads: dict[str, asyncio.Future[JobRow | None]] = {}

    async def answer(self, store: JobStore, signer: UrlSigner, job_id: str, seen: int) -> StatusAnswer | None:
        """The answer for a poll woken because ``job_id`` reached version ``seen`` (-1: unknown).

        None when the job is gone. The row is at ``seen`` or later: an answer or a read
        older than the change that woke the poll is never used.
        """
        at = time.time()
        cached = self._answers.get(job_id)
        if cached is None or seen < 0 or cached.job.version < seen:
            job = await self._read(store, job_id, fresh=seen < 0)
            if job is not None and job.version < seen:
                job = await store.get(job_id)  # a read that began before the change committed
            if job is None:
                return None
            newer = self._answers.get(job_id)  # another poll may have built one meanwhile
            if newer is not None and newer.job.version >= job.version:
                cached, job = newer, newer.job  # never rebuilt below from the older row
            else:
                cached = None
        else:
            job = cached.job
        if (cached is None or cached.expiry != signer.expiry(at)
                or (cached.retry_after is not None and cached.retry_after != retry_after(job, at))):
            cached = status_answer(job, signer, at)
            self._remember(job_id, cached)
        return cached

    def _remember(self, job_id: str, answer: StatusAnswer) -> None:
        self._answers.pop(job_id, None)
        self._answers[job_id] = answer
        if len(self._answers) > self._limit:
            del self._answers[next(iter(self._answers))]  # the least recently built

    async def _read(self, store: JobStore, job_id: str, *, fresh: bool) -> JobRow | None:
        """One store read shared by every poll that asks while it is in flight.

        The first poll reads inline (a SQLite read does not even suspend, so the polls after
        it find the answer built); only polls that come while a read is suspended (the
        PostgreSQL store) wait for it, shielded, so that one going away cannot cancel the
        others' read.
        """
        inflight = None if fresh else self._reads.get(job_id)
        if inflight is not None:
            try:
                return await asyncio.shield(inflight)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not inflight.cancelled() or (task is not None and task.cancelling()):
                    raise  # this poll was cancelled, not the read
                return await store.get(job_id)  # the poll that read went away mid-read
        reading: asyncio.Future[JobRow | None] = asyncio.get_running_loop().create_future()
        if not fresh:
            self._reads[job_id] = reading
        try:
            job = await store.get(job_id)
        except asyncio.CancelledError:
            reading.cancel()
            raise
        except BaseException as exc:
            reading.set_exception(exc)
            reading.exception()  # retrieved: waiters re-raise it; no "never retrieved" log when none
            raise
        else:
            reading.set_result(job)
            return job
        finally:
            if self._reads.get(job_id) is reading:
                del self._reads[job_id]
