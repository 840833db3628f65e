"""What a handler sees of the runtime: where to write, how to report progress, when to stop."""

from __future__ import annotations

from pathlib import Path

from herald.settings import Settings
from herald.jobs import TransitionRejected
from herald.storage.ports import JobStore
from herald.transitions import Change
from workers.errors import JobCancelled, JobLost


class JobContext:
    def __init__(self, *, store: JobStore, settings: Settings, job_id: str, attempt: int, output: Path) -> None:
        self.store = store
        self.settings = settings
        self.job_id = job_id
        self.attempt = attempt
        self.output = output
        self._progress: int | None = None

    async def checkpoint(self) -> None:
        """Call between steps: raises JobCancelled or JobLost when the job must stop."""
        job = await self.store.get(self.job_id)
        if job is None or job.state != "running" or job.attempt != self.attempt:
            raise JobLost(f"job {self.job_id} moved on without this worker")
        if job.cancel_requested:
            raise JobCancelled()

    async def progress(self, percent: int) -> None:
        """Record progress 0..99 (100 is success); a no-op when the percentage did not move."""
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
        self._progress = percent
        if change.after.cancel_requested:
            raise JobCancelled()
