"""What a handler sees of the runtime: where to write, how to report progress, when to stop.

A handler is ``async def handler(ctx: JobContext, params: MyParams) -> None | <JSON-able>``:

* a **file result** is written to ``ctx.output`` (a local scratch file; the worker stores
  it once the handler returns None); a **JSON result** is returned instead (a dict, a list,
  a msgspec Struct...; stored as ``application/json``);
* ``await ctx.progress(pct)`` between steps reports 0..99 (each change is one event);
  ``await ctx.checkpoint()`` between steps without progress to report. Both raise
  ``JobCancelled`` when the client cancelled the job and ``JobLost`` when it moved on
  without this worker: let them propagate (partial output is removed for you). While the
  store is unreachable (PostgreSQL restarting or failing over) neither raises: the run goes
  on, and the progress is recorded by the next call that reaches the store;
* ``await ctx.emit(value)`` streams one output chunk (SPEC §8): anything JSON can encode,
  at most 64 KiB encoded (else ``ChunkTooLarge``, a ValueError), at most
  HERALD_OUTPUT_MAX_BYTES per job (else ``OutputTooLarge``: the job fails
  /problems/output-too-large, even if the handler catches it). It returns once the chunk
  is stored. ``ctx.emit_nowait(value)`` returns a future for that instead: a handler that
  emits faster than a NATS round trip need not wait on each chunk; every chunk is stored
  before the job's end is recorded either way. Once the handler has returned or raised,
  ``emit`` raises ``OutputClosed`` (a RuntimeError): a task it left behind cannot add a
  chunk after the job's end;
* ``raise JobFailed(problem_type, detail)`` ends the job ``failed`` with that problem; any
  other exception ends it ``failed`` with ``/problems/job-failed`` (the traceback goes to
  the worker's log only). Neither is retried;
* a handler may be cancelled (``asyncio.CancelledError``) at any ``await``: the worker is
  shutting down (the job is handed back and starts again, ``ctx.attempt`` + 1), its
  deadline passed or its lease was lost. Use ``try/finally`` for clean-up, never swallow it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from herald.settings import Settings
from herald.jobs import StoreUnavailable, TransitionRejected
from herald.storage.ports import JobStore
from herald.transitions import Change
from workers.errors import JobCancelled, JobLost
from workers.output import OutputWriter

log = logging.getLogger("herald.worker")


class JobContext:
    def __init__(
        self, *, store: JobStore, settings: Settings, job_id: str, attempt: int, output: Path | Callable[[], Path],
        kind: str = "", writer: OutputWriter | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.job_id = job_id
        self.attempt = attempt  # 1 on the first run, +1 each time the job was handed back or re-queued
        self.kind = kind
        # Where a file result goes: made on first use (a handler that returns JSON makes no directory).
        self._output: Path | Callable[[], Path] = output
        self._progress: int | None = None
        self._writer = writer
        self._store_was_away = False  # said once per outage, not once per step

    @property
    def output(self) -> Path:
        """Write a file result here (a local file, only yours, removed unless you succeed)."""
        if not isinstance(self._output, Path):
            self._output = self._output()
        return self._output

    @property
    def output_made(self) -> Path | None:
        """``output`` if the handler asked for it, else None (nothing to clean up)."""
        return self._output if isinstance(self._output, Path) else None

    def _stream(self) -> OutputWriter:
        if self._writer is None:
            raise RuntimeError("this job context has no output stream (no JetStream connection)")
        return self._writer

    async def emit(self, value: Any) -> None:
        """Stream one output chunk; returns once it is stored (durable). See the module's doc."""
        await self._stream().emit(value)

    def emit_nowait(self, value: Any) -> asyncio.Future[None]:
        """Stream one output chunk without waiting: the future is done once it is stored."""
        return self._stream().emit_nowait(value)

    async def checkpoint(self) -> None:
        """Call between steps: raises JobCancelled or JobLost when the job must stop."""
        try:
            job = await self.store.get(self.job_id)
        except StoreUnavailable as exc:
            # A store blip is no verdict on the job (failing it for one threw good work away):
            # carry on; the next checkpoint that reaches the store sees a cancel or a takeover.
            self._store_away("checkpoint skipped", exc)
            return
        self._store_was_away = False
        if job is None or job.state != "running" or job.attempt != self.attempt:
            raise JobLost(f"job {self.job_id} moved on without this worker")
        if job.cancel_requested:
            raise JobCancelled()

    def _store_away(self, what: str, exc: StoreUnavailable) -> None:
        if not self._store_was_away:
            self._store_was_away = True
            log.warning(f"{what}: the store is unreachable; the run goes on",
                        extra={"job_id": self.job_id, "error": str(exc)})

    async def progress(self, percent: int) -> None:
        """Record progress 0..99 (100 is success); a no-op when the percentage did not move.
        Also a checkpoint: raises JobCancelled or JobLost when the job must stop."""
        percent = max(0, min(99, int(percent)))
        if percent == self._progress:
            await self.checkpoint()
            return
        try:
            change = await self.store.transition(
                self.job_id, Change(expect={"running"}, attempt=self.attempt, progress=percent)
            )
        except TransitionRejected as exc:
            raise JobLost(exc.reason) from exc
        except StoreUnavailable as exc:
            # Not recorded (``_progress`` stays): the next call that reaches the store records
            # where the run is by then. The run goes on; its end waits for the store.
            self._store_away("progress not recorded", exc)
            return
        self._store_was_away = False
        self._progress = percent
        if change.after.cancel_requested:
            raise JobCancelled()
