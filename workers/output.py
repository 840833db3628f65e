"""Emitting a job's output chunks into JetStream (SPEC §8), one writer per run.

A handler's ``await ctx.emit(value)`` returns once the chunk is stored (its PubAck came);
``ctx.emit_nowait(value)`` returns a future for that instead, so a handler that emits
faster than a round trip does not wait on each. Either way a single sender task publishes
what was emitted in order, as many as were queued at once (pipelined: every publish of a
batch is on the wire before the first ack is awaited), and the worker waits for every chunk
to be stored before it records the job's end. So a reader that sees the terminal event has
every chunk before it.

Numbering: the first emit of a run reads the job's last stored chunk (one direct get), so a
re-run attempt continues after the chunks already kept and never renumbers them. Each
publish carries ``Nats-Msg-Id: <job>.<n>``: a chunk sent again after a lost ack is dropped
by JetStream's duplicate window, and readers de-duplicate by number beyond it.

JetStream unreachable: the sender retries the unacknowledged chunks in order, with backoff,
for as long as the run lasts (the heartbeat keeps the job's lease without NATS; the job's
deadline or a lost lease cancels the run). An acknowledged chunk is never lost or re-sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.js import JetStreamContext

from herald.constants import CHUNK_HEADER, MAX_CHUNK_BYTES, MSG_ID_HEADER, OUTPUT_BYTES_HEADER, output_subject
from herald.jobs import StoreUnavailable
from herald.output import MAX_UNSTORED, OutputMark, last_mark
from schemas.problems import OUTPUT_TOO_LARGE
from workers.errors import JobFailed, JobLost

log = logging.getLogger("herald.output")

ACK_TIMEOUT_S = 5.0
MAX_BATCH = MAX_UNSTORED  # a batch is stored whole before the next is published
RETRY_MAX_S = 2.0


class ChunkTooLarge(ValueError):
    """One chunk over 64 KiB once encoded as JSON: split it (raised by ``emit``)."""


class OutputClosed(RuntimeError):
    """An emit after the run's handler returned or raised (a task it left behind): the job's
    end is being recorded, and a chunk stored after it would follow the terminal event."""


class OutputTooLarge(JobFailed):
    """The job's output would pass HERALD_OUTPUT_MAX_BYTES: the job fails /problems/output-too-large."""

    def __init__(self, limit: int) -> None:
        super().__init__(OUTPUT_TOO_LARGE, f"the job's streamed output would exceed {limit} bytes "
                                           "(HERALD_OUTPUT_MAX_BYTES)")


@dataclass(slots=True)
class _Pending:
    data: bytes
    future: asyncio.Future[None]
    n: int = 0
    headers: dict[str, str] = field(default_factory=dict)


_encoder = msgspec.json.Encoder()


class OutputWriter:
    """``owns``, when given, says whether the job is still this run's (a store read): asked
    before a batch is published while the run's heartbeat is overdue (``stale_after_s`` since
    the last one recorded, ``beat``). A run whose loop was blocked past the heartbeat timeout
    has had its job re-queued; woken, it must not number chunks into the re-run's output."""

    def __init__(self, js: JetStreamContext, tenant: str, job_id: str, *, max_bytes: int,
                 owns: Callable[[], Awaitable[bool]] | None = None, stale_after_s: float = 0.0) -> None:
        self._js = js
        self._tenant = tenant
        self._job_id = job_id
        self._subject = output_subject(tenant, job_id)
        self._max_bytes = max_bytes
        self._mark: OutputMark | None = None  # read by the sender before its first publish
        self._n = 0
        self._total = 0
        self._queue: list[_Pending] = []  # emitted, not yet handed to the sender
        self._unsent: list[_Pending] = []  # emitted before the mark was read (numbered then)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._outstanding: set[asyncio.Future[None]] = set()
        self.too_large: OutputTooLarge | None = None  # once set, the job fails whatever the handler does
        self._sealed = False  # the run is over: no more chunks (``seal``)
        self._owns = owns
        self._stale_after_s = stale_after_s
        self._beat_at = time.monotonic()  # created just after the claim, which is a heartbeat
        self._asked_at = 0.0  # the last time ``owns`` was asked
        self.lost: JobLost | None = None  # the job moved on without this run: every emit raises it

    @property
    def emitted(self) -> int:
        """The number of the last chunk numbered so far (0: none)."""
        return self._n

    def emit_nowait(self, value: Any) -> asyncio.Future[None]:
        """Queue one chunk; the future is done once it is stored. Raises ``ChunkTooLarge``
        (over 64 KiB), ``OutputTooLarge`` (over HERALD_OUTPUT_MAX_BYTES for the job) or
        ``OutputClosed`` (the run is over)."""
        if self.lost is not None:
            raise self.lost
        if self._sealed:
            raise OutputClosed("this job's run has ended: its output takes no more chunks")
        if self.too_large is not None:
            raise self.too_large
        data = _encoder.encode(value)
        if len(data) > MAX_CHUNK_BYTES:
            raise ChunkTooLarge(f"an output chunk is at most {MAX_CHUNK_BYTES} bytes as JSON; this one is {len(data)}")
        pending = _Pending(data, asyncio.get_running_loop().create_future())
        if self._mark is None:
            self._unsent.append(pending)  # numbered once the job's last kept chunk is known
        else:
            self._number(pending)
            self._queue.append(pending)
        self._outstanding.add(pending.future)
        pending.future.add_done_callback(self._outstanding.discard)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"output-{self._job_id}")
        self._wake.set()
        return pending.future

    async def emit(self, value: Any) -> None:
        """Emit one chunk and return once it is stored (durable)."""
        await self.emit_nowait(value)

    def _number(self, pending: _Pending) -> None:
        if self._total + len(pending.data) > self._max_bytes:
            self.too_large = OutputTooLarge(self._max_bytes)
            raise self.too_large
        self._n += 1
        self._total += len(pending.data)
        pending.n = self._n
        pending.headers = {MSG_ID_HEADER: f"{self._job_id}.{self._n}", CHUNK_HEADER: str(self._n),
                           OUTPUT_BYTES_HEADER: str(self._total)}

    def beat(self) -> None:
        """The run's heartbeat was just recorded: the job is still this run's."""
        self._beat_at = time.monotonic()

    def seal(self) -> None:
        """The run's handler has returned or raised: later emits raise ``OutputClosed``, so that
        every chunk is stored before the job's end is recorded (``flush``), none after it."""
        self._sealed = True

    async def flush(self) -> None:
        """Until every chunk emitted so far is stored (or refused as too large)."""
        while self._outstanding:
            await asyncio.wait(set(self._outstanding))

    async def close(self) -> None:
        self.seal()  # a new emit would start a sender nobody stops
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pending in (*self._unsent, *self._queue):
            if not pending.future.done():
                pending.future.cancel()

    # ----- the sender ---------------------------------------------------------------------

    async def _run(self) -> None:
        if self._mark is None:
            self._mark = await self._retrying(lambda: last_mark(self._js, self._tenant, self._job_id))
            self._n, self._total = self._mark.n, self._mark.total_bytes
            unsent, self._unsent = self._unsent, []
            for pending in unsent:
                if self.too_large is not None:
                    pending.future.set_exception(self.too_large)
                    continue
                try:
                    self._number(pending)
                except OutputTooLarge as exc:
                    pending.future.set_exception(exc)
                    continue
                self._queue.append(pending)
            for pending in unsent:  # a future nobody awaited must not warn "exception never retrieved"
                if pending.future.done() and not pending.future.cancelled():
                    pending.future.exception()
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            if not await self._still_ours():
                self._lose([*batch, *self._queue])
                return
            await self._send(batch)

    async def _send(self, batch: list[_Pending]) -> None:
        """Publish ``batch`` pipelined, in order; resend from the first unacknowledged one until all are stored."""
        delay = 0.1
        while batch:
            acks: list[asyncio.Future[Any]] = []
            try:
                for pending in batch:
                    acks.append(await self._js.publish_async(self._subject, pending.data, headers=pending.headers))
            except Exception as exc:  # noqa: BLE001  (not connected: the rest is sent again below)
                log.debug("output publish failed: %s", exc)
            stored = 0
            if acks:
                await asyncio.wait(acks, timeout=ACK_TIMEOUT_S)  # one wait for the whole batch
            for ack in acks:
                if not ack.done() or ack.cancelled() or ack.exception() is not None:
                    break
                stored += 1
            if stored < len(batch):
                # A lost ack, NATS reconnecting, no stream leader: resent from here on.
                failed = acks[stored] if stored < len(acks) else None
                reason = repr(failed.exception()) if failed is not None and failed.done() and not failed.cancelled() \
                    else "no ack in time"
                log.warning("output chunk not stored yet, retrying", extra={"job_id": self._job_id, "error": reason})
            for ack in acks[stored:]:
                ack.cancel()  # frees its slot in the client; the chunk is sent again
            for pending in batch[:stored]:
                if not pending.future.done():
                    pending.future.set_result(None)
            batch = batch[stored:]
            if batch:
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)

    async def _still_ours(self) -> bool:
        """Whether this run may publish. Its heartbeat recent: yes (the sweeper re-queues a job
        only after HERALD_HEARTBEAT_TIMEOUT_S without one, and ``stale_after_s`` is less). Else
        the store says, asked at most once per half ``stale_after_s`` (a heartbeat's interval),
        not once per batch: while the store is away (its heartbeats failing too) each read
        fails slowly, and the run goes on then, as its heartbeat does."""
        now = time.monotonic()
        if self._owns is None or now - self._beat_at <= self._stale_after_s \
                or now - self._asked_at < self._stale_after_s / 2:
            return True
        self._asked_at = now
        try:
            return await self._owns()
        except Exception as exc:  # noqa: BLE001  (StoreUnavailable, or worse: the sender must not die)
            if not isinstance(exc, StoreUnavailable):
                log.warning("could not tell whether the job is still this run's", extra={"job_id": self._job_id,
                                                                                          "error": repr(exc)})
            return True

    def _lose(self, pending: list[_Pending]) -> None:
        self.lost = JobLost(f"job {self._job_id} moved on without this run: its output takes no more chunks")
        log.warning("output refused: the job moved on without this run", extra={"job_id": self._job_id})
        self._queue = []
        for item in pending:
            if not item.future.done():
                item.future.set_exception(self.lost)
                item.future.exception()  # an emit_nowait nobody awaits must not warn "never retrieved"

    async def _retrying(self, read: Any) -> OutputMark:
        delay = 0.1
        while True:
            try:
                mark: OutputMark = await read()
                return mark
            except Exception as exc:  # noqa: BLE001  (NATS unreachable: the run's lease bounds the wait)
                log.warning("reading the job's output mark failed, retrying", extra={"job_id": self._job_id,
                                                                                      "error": repr(exc)})
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
