"""The worker process: fetch job messages from the durable consumer and run them.

One message runs as: claim (``queued -> running``, conditional), the handler beside a
heartbeat task that extends the JetStream lease and writes ``heartbeat_at``, the result
committed to the result store, then exactly one terminal transition. Every write is
fenced by ``attempt``, so a worker that lost its job (re-queued by the sweeper, failed at
its deadline) can never move it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from herald import jetstream, tracing, workmessage
from herald.kinds import JSON_MEDIA_TYPE
from herald.logs import log_event, log_transition
from herald.metrics import metrics
from herald.relay import Relay
from herald.jobs import JobRow, StoreUnavailable, Transition, TransitionRejected
from herald.settings import Settings
from herald.directory import running_directory
from herald.storage import open_storage
from herald.storage.ports import JobStore, ResultStore
from herald.scratch import remove_orphans_every
from herald.storage.results import open_result_store
from herald.tasks import TaskOwner
from herald.tasks import stop as stop_task
from herald.tenants import DefaultLimits, LimitsSource
from herald.transitions import TENANT_AT_CAP, Change
from schemas import JobMessage
from schemas.problems import JOB_FAILED
from workers import registry
from workers.context import JobContext
from workers.dispatch import Dispatch, KindQueue, TenantQueue
from workers.errors import JobCancelled, JobFailed, JobLost
from workers.output import OutputWriter

# A run's own lines (started, succeeded...) go through ``log_event``: rendered straight to JSON,
# without the LogRecord and structlog chain, which cost as much as the rest of a trivial run's
# bookkeeping (bench/RESULTS.md, issue 24).
log = logging.getLogger("herald.worker")

FETCH_BATCH = 16  # at most this many slots handed out at once
# A JSON result up to this size is kept in the job's row by the success's own transaction,
# where the store keeps results (SQLite): no file, no fsync, no second write. Larger ones,
# and every result on a store that keeps none, go through the result store.
ROW_RESULT_MAX_BYTES = 64 * 1024
PARKED_POLL_S = 0.25  # a claim refused at the tenant's max_running tries again this often
# A write the store could not take (StoreUnavailable: PostgreSQL restarting, failing over, a
# connection lost mid-statement) is tried again after this, doubling up to the second.
STORE_RETRY_FIRST_S = 0.1
STORE_RETRY_MAX_S = 2.0

T = TypeVar("T")


class _Slot:
    """A run's place in the process's and its kind's budgets, released once (or given back
    while its claim waits for the tenant's max_running, then taken again)."""

    def __init__(self, process: asyncio.Semaphore, kind: asyncio.Semaphore) -> None:
        self._process, self._kind = process, kind
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._process.release()
            self._kind.release()

    async def acquire(self) -> None:
        if not self.held:
            await self._kind.acquire()
            await self._process.acquire()
            self.held = True


class Worker:
    def __init__(
        self, settings: Settings, store: JobStore, results: ResultStore, kinds: Mapping[str, registry.JobKind],
        limits: LimitsSource | None = None, js: JetStreamContext | None = None,
    ) -> None:
        self.settings = settings
        self.js = js  # where handlers' output chunks go (SPEC §8); None: ctx.emit raises
        self.store = store
        self.results = results
        self.kinds = dict(kinds)
        self.limits: LimitsSource = limits if limits is not None else DefaultLimits(settings)
        # One budget for the process (HERALD_WORKER_CONCURRENCY), and one per kind within it.
        self._slots = asyncio.Semaphore(settings.worker_concurrency)
        self._kind_slots = {name: asyncio.Semaphore(kind.concurrency) for name, kind in self.kinds.items()}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    # ----- the loop -----------------------------------------------------------------

    async def run(self, dispatch: Dispatch, stop: asyncio.Event) -> None:
        """One dispatch loop per kind (workers/dispatch.py), and the reader of the tenants'
        work counts; on ``stop`` let running jobs finish or hand them back."""
        async with asyncio.TaskGroup() as group:
            group.create_task(dispatch.run_refresh(stop), name="work-counts")
            for name, queue in dispatch.kinds.items():
                group.create_task(self._dispatch_loop(queue, stop), name=f"dispatch-{name}")

    async def _dispatch_loop(self, queue: KindQueue, stop: asyncio.Event) -> None:
        """Give each free slot (of the process and of the kind) to the tenant whose turn it is.

        Free slots are handed out together: one request per chosen tenant asks for as many
        messages as it was given slots. With no tenant to ask, the slots go back (another
        kind may use the process's) and the loop waits to hear of work.
        """
        kind = queue.kind.name
        kind_slots = self._kind_slots[kind]
        while not stop.is_set():
            await kind_slots.acquire()
            await self._slots.acquire()
            taken = 1
            # Semaphore.acquire() on a free semaphore returns without yielding: no one else
            # can take these slots between the check and the acquire.
            while taken < FETCH_BATCH and not kind_slots.locked() and not self._slots.locked():
                await kind_slots.acquire()
                await self._slots.acquire()
                taken += 1
            picks = queue.choose(taken)
            if not picks:
                self._release(kind, taken)
                queue.wake.clear()
                if not queue.ready():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(_first(queue.wake.wait(), stop.wait()),
                                               timeout=max(0.005, queue.next_probe_in()))
                continue
            self._release(kind, taken - len(picks))
            batches: dict[TenantQueue, int] = {}
            for pick in picks:
                batches[pick] = batches.get(pick, 0) + 1
            try:
                results = await asyncio.gather(*(queue.take(tenant, n) for tenant, n in batches.items()),
                                               return_exceptions=True)
            except asyncio.CancelledError:
                self._release(kind, len(picks))
                raise
            for (tenant, n), result in zip(batches.items(), results):
                if isinstance(result, BaseException):  # NATS reconnecting: wait and try again
                    self._release(kind, n)
                    tenant.probe_after = time.monotonic() + 0.5
                    log.warning("fetch failed: %s", result, extra={"kind": kind})
                    continue
                self._release(kind, n - len(result))
                for message in result:
                    slot = _Slot(self._slots, kind_slots)
                    task = asyncio.create_task(self._handle(message, slot))
                    self._tasks.add(task)
                    task.add_done_callback(functools.partial(self._done, slot=slot, queue=queue, tenant=tenant,
                                                             started=time.monotonic()))

    def _release(self, kind: str, slots: int = 1) -> None:
        for _ in range(slots):
            self._slots.release()
            self._kind_slots[kind].release()

    def _done(self, task: asyncio.Task[None], slot: _Slot, queue: KindQueue, tenant: TenantQueue,
              started: float) -> None:
        self._tasks.discard(task)
        slot.release()
        queue.finished(tenant, time.monotonic() - started)
        if not task.cancelled() and task.exception() is not None:
            log.error("worker task crashed", exc_info=task.exception())

    async def shutdown(self, grace_s: float) -> None:
        """Give running jobs ``grace_s`` to finish, then hand the rest back (re-queue)."""
        self._stopping.set()
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    # ----- one message ----------------------------------------------------------------

    async def _handle(self, message: Msg, slot: _Slot) -> None:
        try:
            work = workmessage.decode(message.data)
        except msgspec.DecodeError:
            log.error("undecodable job message dropped", extra={"subject": message.subject})
            await message.term()
            return
        try:
            job = await self._until_stored(lambda: job_of(work, self.store), work.job_id, "read", message)
        except StoreUnavailable:  # stopping while the store is away: another worker takes the message
            with contextlib.suppress(Exception):
                await message.nak()
            return
        kind = self.kinds.get(work.kind)
        if job is None or job.state != "queued" or kind is None:
            # Terminal, deleted, or running under another worker (whose death the sweeper
            # handles): this message has nothing left to do.
            if kind is None and job is not None:  # only on a misrouted message: each kind has its consumer
                log.error("no handler for kind", extra={"job_id": work.job_id, "kind": work.kind})
            await message.ack()
            return
        if job.cancel_requested:
            # Handed back (its worker stopping) after its cancel was asked for, before any run saw
            # it: cancelled now, as the client asked (SPEC §5), not started again.
            await self._cancel_handed_back(job, message)
            return
        # The attempt's span, in the job's trace (continued from the message's headers).
        attributes = {"messaging.system": "nats", "messaging.operation.type": "process",
                      "messaging.destination.name": message.subject, "herald.job.id": job.id,
                      "herald.job.kind": job.kind}
        with tracing.span(f"run {job.kind}", tracing.continued(message.headers, job), kind=tracing.SpanKind.CONSUMER,
                          attributes=attributes) as span:
            claimed = await self._claim(job, message, slot)
            if claimed is None:
                return
            span.set_attribute("herald.job.attempt", claimed.attempt)
            metrics().job_started(claimed, self.settings.metrics_tenant_labels)
            await self._run_claimed(claimed, kind, message)

    async def _cancel_handed_back(self, job: JobRow, message: Msg) -> None:
        cancel = Change(expect={"queued"}, to="cancelled")
        try:
            await self._until_stored(lambda: self.store.transition(job.id, cancel), job.id, "cancel", message)
        except StoreUnavailable:  # stopping while the store is away: another worker takes the message
            with contextlib.suppress(Exception):
                await message.nak()
            return
        except TransitionRejected as exc:  # claimed or ended meanwhile: nothing left for this message
            log.info("cancel rejected", extra={"job_id": job.id, "reason": exc.reason})
        else:
            log_event(log, logging.INFO, "job cancelled", {"job_id": job.id})
        await message.ack()

    async def _claim(self, job: JobRow, message: Msg, slot: _Slot) -> JobRow | None:
        """``queued -> running``, within the tenant's max_running (counted by the store).

        A claim refused at the cap (another kind's run of the tenant took the last place, or
        a cap lowered just now) keeps its message, gives its slot back, and tries again once
        the tenant runs fewer; the message's lease is kept alive meanwhile, so it is not
        redelivered and spends none of its deliveries. None: nothing to run (message acked,
        or handed back on shutdown)."""
        while True:
            cap = self.limits.limits(job.tenant).max_running
            claim = Change(expect={"queued"}, to="running", claim=True, max_running=cap)
            tries = 0

            async def try_claim(claim: Change = claim) -> Transition:
                nonlocal tries
                tries += 1
                return await self.store.transition(job.id, claim)

            try:
                return (await self._until_stored(try_claim, job.id, "claim", message)).after
            except StoreUnavailable:  # stopping while the store is away: another worker takes the message
                with contextlib.suppress(Exception):
                    await message.nak()
                return None
            except TransitionRejected as exc:
                if tries > 1 and _is_own_claim(exc.current, job):
                    # A try the store committed though its answer was lost (the connection
                    # broke after the commit): the job is this run's. Acked, it was left
                    # running with no worker until the sweeper judged its heartbeat silent.
                    log.info("claim recorded though its answer was lost", extra={"job_id": job.id})
                    assert exc.current is not None
                    return exc.current
                if exc.reason != TENANT_AT_CAP:
                    log.info("claim rejected", extra={"job_id": job.id, "reason": exc.reason})
                    await message.ack()
                    return None
            metrics().claims_at_cap.labels(kind=job.kind).inc()
            slot.release()
            try:
                while True:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), timeout=PARKED_POLL_S)
                    if self._stopping.is_set():
                        await message.nak()  # another worker takes it at once
                        return None
                    with contextlib.suppress(Exception):
                        await message.in_progress()
                    current = await self.store.get(job.id)
                    if current is None or current.state != "queued":
                        await message.ack()
                        return None
                    cap = self.limits.limits(job.tenant).max_running
                    running = (await self.store.running_counts([job.tenant])).get(job.tenant, 0)
                    if cap <= 0 or running < cap:
                        break
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await message.nak()
                raise
            await slot.acquire()

    async def _run_claimed(self, job: JobRow, kind: registry.JobKind, message: Msg) -> None:
        params = msgspec.json.decode(job.params, type=kind.params)
        # Two heartbeats missed: the job may have been re-queued; the writer asks before it publishes.
        writer = (OutputWriter(self.js, job.tenant, job.id, max_bytes=self.settings.output_max_bytes,
                               owns=functools.partial(self._owns, job),
                               stale_after_s=2 * self.settings.heartbeat_interval_s)
                  if self.js is not None else None)
        context = JobContext(store=self.store, settings=self.settings, job_id=job.id, attempt=job.attempt,
                             output=functools.partial(self.results.scratch_path, job.id, job.attempt,
                                                      kind.suffix(params)),
                             kind=job.kind, writer=writer)
        log_event(log, logging.INFO, "job started", {"job_id": job.id, "kind": job.kind, "attempt": job.attempt})
        # Set just before this run writes the job's end: a beat that finds the job no longer
        # running after that is the run's own doing, not a takeover.
        ending = asyncio.Event()
        heart = asyncio.create_task(self._heartbeat(job, message, asyncio.current_task(), ending, writer))
        json_scratch: Path | None = None  # a JSON result too large for the row, on its way to the result store
        try:
            with tracing.span(f"handler {job.kind}", attributes={"herald.job.attempt": job.attempt}):
                value = await kind.handler(context, params)
            # Every chunk is stored before the job's end is recorded: a reader that sees the
            # terminal event has them all. Over the job's limit, the job fails (even if the
            # handler caught the error).
            await _flush(writer)
            if writer is not None and writer.too_large is not None:
                raise writer.too_large
            body = msgspec.json.encode(value) if value is not None else None
            key: str | None = None
            if body is not None and self.store.keeps_results and len(body) <= ROW_RESULT_MAX_BYTES:
                # Kept in the row by the success itself: stored exactly when the job is marked
                # succeeded (SPEC §6), in one commit, with no file and no fsync of its own.
                _remove_scratch(context.output_made)
                success = Change(expect={"running"}, to="succeeded", attempt=job.attempt, result_body=body,
                                 media_type=JSON_MEDIA_TYPE)
            else:
                if body is not None:  # a JSON result: stored like a file, served as application/json
                    _remove_scratch(context.output_made, json_scratch)
                    output = json_scratch = self.results.scratch_path(job.id, job.attempt, ".json")
                    await asyncio.to_thread(output.write_bytes, body)
                    media_type = JSON_MEDIA_TYPE
                else:
                    output = context.output
                    media_type = kind.media_type(params)
                    if not output.exists():
                        raise RuntimeError(f"the {job.kind} handler returned None but wrote no result to ctx.output")
                # The heartbeat (and the JetStream lease) keeps running until the success is
                # committed: storing the result can take seconds (a NATS leader election), and a
                # silent job would be swept away from under a live worker.
                with tracing.span("result commit"):
                    key = await self.results.commit(job.id, job.attempt, output)
                success = Change(expect={"running"}, to="succeeded", attempt=job.attempt, result_path=key,
                                 media_type=media_type)
            ending.set()
            try:
                await self._until_stored(lambda: self.store.transition(job.id, success), job.id, "success")
            except TransitionRejected as exc:
                if _is_own_success(exc.current, success):
                    # A try the store committed though its answer was lost (the connection
                    # broke after the commit): the job is this run's, result and all.
                    log_event(log, logging.INFO, "job succeeded", {"job_id": job.id})
                else:
                    if key is not None:
                        await self.results.discard(key)
                    log.warning("success not recorded", extra={"job_id": job.id, "reason": exc.reason})
            else:
                log_event(log, logging.INFO, "job succeeded", {"job_id": job.id})
        except JobCancelled:
            _remove_scratch(context.output_made, json_scratch)
            await _flush(writer)
            await self._finish(job, Change(expect={"running"}, to="cancelled", attempt=job.attempt), ending)
            log_event(log, logging.INFO, "job cancelled", {"job_id": job.id})
        except JobFailed as exc:
            _remove_scratch(context.output_made, json_scratch)
            await _flush(writer)
            problem = writer.too_large.problem if writer is not None and writer.too_large is not None else exc.problem
            await self._finish(job, Change(expect={"running"}, to="failed", attempt=job.attempt, error=problem), ending)
            log_event(log, logging.INFO, "job failed", {"job_id": job.id, "problem_type": problem.type})
        except JobLost as exc:
            _remove_scratch(context.output_made, json_scratch)
            log.info("job lost to another writer", extra={"job_id": job.id, "reason": str(exc)})
        except asyncio.CancelledError:
            # Shutdown or lost lease: hand the job back so another worker starts it afresh.
            _remove_scratch(context.output_made, json_scratch)
            if self._stopping.is_set():
                await self._finish(job, Change(expect={"running"}, to="queued", attempt=job.attempt, requeue=True),
                                   ending)
                log.info("job handed back on shutdown", extra={"job_id": job.id})
            raise  # cleaned up; the cancellation still ends this task (whoever cancelled awaits it)
        except StoreUnavailable:
            # The worker is stopping while the store is away (until then a write is tried again):
            # the job's end is not recorded, and it is not the job's fault. The job stays running
            # with no heartbeat, and the sweeper re-queues it, as it does a dead worker's. (The
            # result, if stored, goes with the job at retention.)
            _remove_scratch(context.output_made, json_scratch)
            log.warning("job left to the sweeper: the store is unreachable and the worker is stopping",
                        extra={"job_id": job.id})
        except Exception:
            _remove_scratch(context.output_made, json_scratch)
            log.exception("job handler raised", extra={"job_id": job.id})
            await _flush(writer)
            problem = JOB_FAILED.problem(
                f"the {job.kind} handler stopped with an internal error; see the worker log for job {job.id}"
            )
            if writer is not None and writer.too_large is not None:
                problem = writer.too_large.problem
            await self._finish(job, Change(expect={"running"}, to="failed", attempt=job.attempt, error=problem), ending)
        finally:
            if writer is not None:
                await writer.close()
            await stop_task(heart)
            with contextlib.suppress(Exception):
                await message.ack()

    async def _finish(self, job: JobRow, change: Change, ending: asyncio.Event) -> None:
        ending.set()
        try:
            await asyncio.shield(self._until_stored(lambda: self.store.transition(job.id, change), job.id,
                                                    change.to or "transition"))
        except TransitionRejected as exc:
            if _is_own_end(exc.current, change):
                # A try the store committed though its answer was lost: the end is recorded.
                log.info("end recorded though its answer was lost", extra={"job_id": job.id, "to": change.to})
            else:
                log.warning("transition rejected", extra={"job_id": job.id, "reason": exc.reason, "to": change.to})
        except StoreUnavailable:  # stopping while the store is away: the sweeper re-queues the job
            log.warning("transition not recorded: the store is unreachable and the worker is stopping",
                        extra={"job_id": job.id, "to": change.to})

    async def _until_stored(self, call: Callable[[], Awaitable[T]], job_id: str, what: str,
                            message: Msg | None = None) -> T:
        """``call()``, again until the store answers it. ``StoreUnavailable`` (PostgreSQL
        restarting or failing over, a connection lost mid-statement) says nothing about the
        job: a run whose end could not be written is not a failed job, and a message whose
        claim could not be written must not be given back to JetStream, whose redeliveries
        are counted (``max_deliver``): a few of them during an outage and the message was
        never delivered again, its job queued until its deadline. So the call is repeated
        (``message``'s lease extended meanwhile, where no heartbeat does it), and the outage
        only delays the job. Raises ``StoreUnavailable`` once the worker is stopping."""
        delay = STORE_RETRY_FIRST_S
        said = False
        while True:
            try:
                return await call()
            except StoreUnavailable as exc:
                if self._stopping.is_set():
                    raise
                if not said:
                    said = True
                    log.warning("the store is unreachable; trying again", extra={"job_id": job_id, "write": what,
                                                                                 "error": str(exc)})
            if message is not None:
                with contextlib.suppress(Exception):
                    await message.in_progress()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=delay)
            delay = min(delay * 2, STORE_RETRY_MAX_S)

    async def _owns(self, job: JobRow) -> bool:
        """Whether ``job`` is still running under this run's attempt (a store read)."""
        current = await self.store.get(job.id)
        return current is not None and current.state == "running" and current.attempt == job.attempt

    async def _heartbeat(self, job: JobRow, message: Msg, runner: asyncio.Task[None] | None,
                         ending: asyncio.Event, writer: OutputWriter | None = None) -> None:
        """Extend the lease and write heartbeats; stop the run if the job was taken away (not
        when the run itself is writing its end: ``ending``)."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            with contextlib.suppress(Exception):
                await message.in_progress()
            try:
                alive = await self.store.heartbeat(job.id, job.attempt)
            except Exception as exc:
                log.warning("heartbeat failed", extra={"job_id": job.id, "error": str(exc)})
                continue
            if alive is not None and writer is not None:
                writer.beat()
            if alive is None:
                if ending.is_set():
                    return  # the run ended it; the run acks its message
                log.info("job taken away, stopping", extra={"job_id": job.id})
                if runner is not None:
                    runner.cancel()
                return


async def job_of(work: JobMessage, store: JobStore) -> JobRow | None:
    """The job of a work message, to claim: as the message carries it (queued, at the
    version the message was made for), else read. Either way it is handed to the store as
    the row the claim is judged on (``JobStore.remember``): on PostgreSQL the claim is one
    compare-and-set with no read before it, on SQLite it is judged outside the write lock.
    A row the job has left since (cancelled, deleted, claimed elsewhere) makes that
    compare-and-set miss, and the store reads the job and judges again: the claim is
    refused, the message acked, as when the read said so first."""
    job = workmessage.carried_row(work)
    if job is None:
        job = await store.get(work.job_id)
    if job is not None:
        store.remember(job)
    return job


def _is_own_claim(current: JobRow | None, queued: JobRow) -> bool:
    """Whether the job as it is now is a claim of ``queued`` committed, untouched since: a
    claim whose answer was lost. Its message is this worker's (JetStream leases it to one
    consumer, and the retries kept the lease), so only a second message of the same job,
    delivered at the same moment to another worker, could have claimed it instead."""
    return (current is not None and current.state == "running" and current.attempt == max(queued.attempt, 1)
            and current.version == queued.version + 1 and not current.progress)


def _is_own_success(current: JobRow | None, success: Change) -> bool:
    """Whether the job as it is now is ``success`` committed: a success whose answer was lost."""
    return (current is not None and current.state == "succeeded" and current.attempt == success.attempt
            and current.result_path == success.result_path
            and (success.result_body is None or current.result_body == success.result_body))


def _is_own_end(current: JobRow | None, end: Change) -> bool:
    """Whether the job as it is now is ``end`` (failed or cancelled) committed at this run's
    attempt: an end whose answer was lost, not one refused."""
    return (current is not None and end.to in ("failed", "cancelled") and current.state == end.to
            and current.attempt == end.attempt
            and (end.error is None or current.error == msgspec.json.encode(end.error)))


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Until the first of ``waits`` ends (the others are cancelled)."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _flush(writer: OutputWriter | None) -> None:
    """Once the handler has returned or raised: no more chunks, and every one emitted stored."""
    if writer is not None:
        writer.seal()
        await writer.flush()


def _remove_scratch(*paths: Path | None) -> None:
    """An attempt that did not succeed leaves no partial output behind."""
    for path in paths:
        if path is not None:
            path.unlink(missing_ok=True)


async def run_worker(settings: Settings, stop: asyncio.Event, limits: LimitsSource | None = None) -> None:
    """The ``herald worker`` process body.

    Every resource and task is entered on one owner (``herald.tasks.TaskOwner``), so whichever
    step fails (the store, NATS, the topology, the result store), what was already started is
    stopped and awaited in reverse order: no task outlives the store it uses.
    """
    kinds = registry.load(settings)  # import every handler now: a broken one stops the worker at start, by name
    async with TaskOwner() as owner:
        storage = await open_storage(settings)
        owner.push_async_callback(storage.close)
        store = storage.jobs
        store.on_commit(log_transition)
        store.on_commit(metrics().observe)
        nc = await jetstream.connect_until_ready(settings, name="herald-worker", stop=stop)
        if nc is None:
            return
        owner.push_async_callback(_drain, nc)
        # Tenants' limits as they change at run time (SPEC §12, §13).
        directory = await owner.enter_async_context(running_directory(settings, storage, nc))
        limits = limits if limits is not None else directory
        js = nc.jetstream()
        try:
            await jetstream.until_stopped(jetstream.ensure_topology(js, settings), stop)
        except jetstream.Stopped:
            return
        relay = Relay(store, nc, sweep_interval_s=settings.sweep_interval_s)
        # Unwound in reverse: the loop stops, then its last pass sends what the last runs and the
        # shutdown's hand-backs committed.
        owner.push_async_callback(relay.finish)
        owner.spawn(relay.run(), "relay")
        # Each kind's work is pulled per tenant (workers/dispatch.py): consumers are made as tenants need them.
        dispatch = Dispatch(nc, js, settings, (kind.declaration for kind in kinds.values()), limits)
        await dispatch.start()
        owner.push_async_callback(dispatch.stop)
        results = await open_result_store(settings, js)
        owner.push_async_callback(results.close)  # after the runs below: its scratch dir goes with it
        # Scratch dirs of workers that are gone (killed mid-job): this worker's restart, or a
        # sibling on the same data dir, removes them (herald.scratch).
        owner.spawn(remove_orphans_every(settings.scratch_dir), "scratch-orphans")
        worker = Worker(settings, store, results, kinds, limits, js=js)
        owner.push_async_callback(worker.shutdown, settings.worker_grace_s)
        owner.spawn(worker.run(dispatch, stop), "fetch")
        log.info("worker ready", extra={
            "concurrency": settings.worker_concurrency,
            "kinds": {name: kind.concurrency for name, kind in kinds.items()},
        })
        await stop.wait()
        log.info("worker stopping")


async def _drain(nc: NATS) -> None:
    try:
        await asyncio.wait_for(nc.drain(), timeout=5.0)
    except Exception:  # reconnecting, or a subscription that will not drain: close instead
        with contextlib.suppress(Exception):
            await nc.close()
