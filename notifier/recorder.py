"""Recording attempts in batches: one transaction for all attempts that finished together.

Each attempt's outcome must be committed before the attempt counts as done: its lease is
released in the same transaction, and it is logged only after the commit, so a crash
between the HTTP answer and the commit leaves the delivery leased and unrecorded, and it
is sent again once the lease runs out (at-least-once, as before). Its slot towards the
target was freed when the target answered: the commit does not load the receiver.

Why batches: one transaction per attempt cost more than the HTTP POST itself (the writer
thread hop, ``BEGIN IMMEDIATE``, the commit; on PostgreSQL a round trip and a commit
each). Attempts whose answers arrive in the same loop turn, or while the previous batch
is being written, go into the next batch: there is never more than one batch in flight
per process, so under load batches grow by themselves, and an attempt finishing on an idle
notifier waits only one loop turn. No timer, no fixed window.

If a batch fails (the store is busy or away, or one attempt in it is refused), its attempts
are recorded one by one, so one bad attempt cannot keep the others unrecorded; whatever
still fails raises in its own attempt. An attempt whose store was unreachable is recorded
again by the scheduler while its lease lasts (``Scheduler._record``); one that still fails
keeps its lease until it runs out, and its delivery is sent again. Recording an attempt again
(here one by one, or by the scheduler) never logs it twice: the store knows it by its id
(``Attempted.id``), so a record that committed but whose answer was lost is a no-op.
"""

from __future__ import annotations

import asyncio
import logging

from herald.deliveries import Attempted, Finished
from herald.storage.ports import DeliveryQueue

log = logging.getLogger("herald.notifier")

MAX_BATCH = 512  # bounds one transaction's length (and the lock it holds) under a large backlog


class Recorder:
    def __init__(self, queue: DeliveryQueue, owner: str, *, max_batch: int = MAX_BATCH) -> None:
        self.queue = queue
        self.owner = owner
        self.max_batch = max_batch
        self._waiting: list[tuple[Attempted, asyncio.Future[Finished]]] = []
        self._writer: asyncio.Task[None] | None = None
        self.batches = 0  # how many transactions recorded attempts (tests, diagnostics)

    async def record(self, attempt: Attempted) -> Finished:
        """Returns once the attempt and its consequence are committed; raises if they could not be."""
        future: asyncio.Future[Finished] = asyncio.get_running_loop().create_future()
        self._waiting.append((attempt, future))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write(), name="webhook-outcomes")
        return await future

    async def close(self) -> None:
        """Wait for the batch being written (shutdown: before the store is closed)."""
        if self._writer is not None:
            await asyncio.shield(self._writer)

    async def _write(self) -> None:
        try:
            while self._waiting:
                # One more loop turn: the other attempts whose answers came in this turn join.
                await asyncio.sleep(0)
                batch = self._waiting[: self.max_batch]
                del self._waiting[: self.max_batch]
                # An attempt cancelled before it was written (shutdown) stays unrecorded and
                # leased: its lease is handed back and it is sent again (at-least-once).
                batch = [(attempt, future) for attempt, future in batch if not future.done()]
                if not batch:
                    continue
                try:
                    await self._write_batch(batch)
                except BaseException as exc:  # never leave an attempt waiting for an answer
                    error = exc if isinstance(exc, Exception) else RuntimeError("the outcome recorder stopped")
                    for _attempt, future in [*batch, *self._waiting]:
                        _settle(future, error)
                    self._waiting.clear()
                    raise
        finally:
            self._writer = None

    async def _write_batch(self, batch: list[tuple[Attempted, asyncio.Future[Finished]]]) -> None:
        try:
            results = await self.queue.finish_many([attempt for attempt, _ in batch], self.owner)
            self.batches += 1
        except Exception as exc:
            if len(batch) == 1:
                _settle(batch[0][1], exc)
                return
            log.warning("recording %d webhook attempts together failed, recording them one by one: %s",
                        len(batch), exc)
            for attempt, future in batch:
                try:
                    (alone,) = await self.queue.finish_many([attempt], self.owner)
                    self.batches += 1
                except Exception as one_exc:
                    _settle(future, one_exc)
                else:
                    _settle(future, alone)
            return
        for (_attempt, future), finished in zip(batch, results, strict=True):
            _settle(future, finished)


def _settle(future: asyncio.Future[Finished], result: Finished | BaseException) -> None:
    if future.done():  # its attempt was cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
