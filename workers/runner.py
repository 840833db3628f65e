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
from collections.abc import Mapping

from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from herald import jetstream, tracing
from herald.constants import JOBS_STREAM, worker_consumer_name
from herald.kinds import JSON_MEDIA_TYPE
from herald.logs import log_transition
from herald.metrics import metrics
from herald.relay import Relay
from herald.jobs import JobRow, TransitionRejected
from herald.settings import Settings
from herald.directory import running_directory
from herald.storage import open_storage
from herald.storage.ports import JobStore, ResultStore
from herald.storage.results import open_result_store
from herald.transitions import Change
from schemas import JobMessage
from schemas.problems import JOB_FAILED
from workers import registry
from workers.context import JobContext
from workers.errors import JobCancelled, JobFailed, JobLost

log = logging.getLogger("herald.worker")

FETCH_BATCH = 16  # at most this many messages per pull request (and never more than free slots)
BATCH_LINGER_S = 0.005
_message_decoder = msgspec.msgpack.Decoder(JobMessage)


class Worker:
    def __init__(
        self, settings: Settings, store: JobStore, results: ResultStore, kinds: Mapping[str, registry.JobKind]
    ) -> None:
        self.settings = settings
        self.store = store
        self.results = results
        self.kinds = dict(kinds)
        # One budget for the process (HERALD_WORKER_CONCURRENCY), and one per kind within it.
        self._slots = asyncio.Semaphore(settings.worker_concurrency)
        self._kind_slots = {name: asyncio.Semaphore(kind.concurrency) for name, kind in self.kinds.items()}
        # A fetch waits holding a slot: with more kinds than slots, shorter waits let every kind have its turn.
        self._fetch_timeout_s = 1.0 if len(self.kinds) <= settings.worker_concurrency else 0.2
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    # ----- the loop -----------------------------------------------------------------

    async def run(self, subscriptions: Mapping[str, object], stop: asyncio.Event) -> None:
        """One fetch loop per kind, each on its kind's durable consumer; on ``stop`` let
        running jobs finish or hand them back."""
        async with asyncio.TaskGroup() as group:
            for name, subscription in subscriptions.items():
                group.create_task(self._fetch_loop(name, subscription, stop), name=f"fetch-{name}")

    async def _fetch_loop(self, kind: str, subscription: object, stop: asyncio.Event) -> None:
        """Fetch while this kind and the process both have a free slot.

        One pull request asks for as many messages as there are free slots once the last one
        came back full (a backlog); otherwise for one. A request for several that finds the
        queue empty lingers on the server until its expiry and returns only then, so it is
        kept short (``BATCH_LINGER_S``): at worst a job at the end of a burst waits that long.
        """
        fetch = subscription.fetch  # type: ignore[attr-defined]
        kind_slots = self._kind_slots[kind]
        backlog = False
        while not stop.is_set():
            await kind_slots.acquire()
            await self._slots.acquire()
            taken = 1
            # Semaphore.acquire() on a free semaphore returns without yielding: no one else
            # can take these slots between the check and the acquire.
            while backlog and taken < FETCH_BATCH and not kind_slots.locked() and not self._slots.locked():
                await kind_slots.acquire()
                await self._slots.acquire()
                taken += 1
            try:
                if taken > 1:
                    try:
                        messages: list[Msg] = await fetch(batch=taken, timeout=BATCH_LINGER_S)
                    except (NatsTimeout, asyncio.TimeoutError):
                        messages = []
                else:
                    messages = await fetch(batch=1, timeout=self._fetch_timeout_s)
            except (NatsTimeout, asyncio.TimeoutError):
                messages = []
            except asyncio.CancelledError:
                self._release(kind, taken)
                raise
            except Exception as exc:  # NATS reconnecting: wait and try again
                self._release(kind, taken)
                backlog = False
                log.warning("fetch failed: %s", exc, extra={"kind": kind})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
                continue
            backlog = len(messages) >= taken
            if len(messages) < taken:
                self._release(kind, taken - len(messages))
            for message in messages:
                task = asyncio.create_task(self._handle(message))
                self._tasks.add(task)
                task.add_done_callback(functools.partial(self._done, kind=kind))

    def _release(self, kind: str, slots: int = 1) -> None:
        for _ in range(slots):
            self._slots.release()
            self._kind_slots[kind].release()

    def _done(self, task: asyncio.Task[None], kind: str) -> None:
        self._tasks.discard(task)
        self._release(kind)
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

    async def _handle(self, message: Msg) -> None:
        try:
            work = _message_decoder.decode(message.data)
        except msgspec.DecodeError:
            log.error("undecodable job message dropped", extra={"subject": message.subject})
            await message.term()
            return
        job = await self.store.get(work.job_id)
        kind = self.kinds.get(work.kind)
        if job is None or job.state != "queued" or kind is None:
            # Terminal, deleted, or running under another worker (whose death the sweeper
            # handles): this message has nothing left to do.
            if kind is None and job is not None:  # only on a misrouted message: each kind has its consumer
                log.error("no handler for kind", extra={"job_id": work.job_id, "kind": work.kind})
            await message.ack()
            return
        # The attempt's span, in the job's trace (continued from the message's headers).
        attributes = {"messaging.system": "nats", "messaging.operation.type": "process",
                      "messaging.destination.name": message.subject, "herald.job.id": job.id,
                      "herald.job.kind": job.kind}
        with tracing.span(f"run {job.kind}", tracing.continued(message.headers, job), kind=tracing.SpanKind.CONSUMER,
                          attributes=attributes) as span:
            try:
                claimed = await self.store.transition(job.id, Change(expect={"queued"}, to="running", claim=True))
            except TransitionRejected as exc:
                log.info("claim rejected", extra={"job_id": job.id, "reason": exc.reason})
                await message.ack()
                return
            span.set_attribute("herald.job.attempt", claimed.after.attempt)
            await self._run_claimed(claimed.after, kind, message)

    async def _run_claimed(self, job: JobRow, kind: registry.JobKind, message: Msg) -> None:
        params = msgspec.json.decode(job.params, type=kind.params)
        output = self.results.scratch_path(job.id, job.attempt, kind.suffix(params))
        context = JobContext(store=self.store, settings=self.settings, job_id=job.id, attempt=job.attempt, output=output,
                             kind=job.kind)
        log.info("job started", extra={"job_id": job.id, "kind": job.kind, "attempt": job.attempt})
        heart = asyncio.create_task(self._heartbeat(job, message, asyncio.current_task()))
        try:
            with tracing.span(f"handler {job.kind}", attributes={"herald.job.attempt": job.attempt}):
                value = await kind.handler(context, params)
            if value is not None:  # a JSON result: stored like a file, served as application/json
                _remove_scratch(output)
                output = self.results.scratch_path(job.id, job.attempt, ".json")
                await asyncio.to_thread(output.write_bytes, msgspec.json.encode(value))
                media_type = JSON_MEDIA_TYPE
            else:
                media_type = kind.media_type(params)
                if not output.exists():
                    raise RuntimeError(f"the {job.kind} handler returned None but wrote no result to ctx.output")
            # The heartbeat (and the JetStream lease) keeps running until the success is
            # committed: storing the result can take seconds (a NATS leader election), and a
            # silent job would be swept away from under a live worker.
            with tracing.span("result commit"):
                key = await self.results.commit(job.id, job.attempt, output)
            try:
                await self.store.transition(
                    job.id,
                    Change(expect={"running"}, to="succeeded", attempt=job.attempt, result_path=key,
                           media_type=media_type),
                )
            except TransitionRejected as exc:
                await self.results.discard(key)
                log.warning("success not recorded", extra={"job_id": job.id, "reason": exc.reason})
            else:
                log.info("job succeeded", extra={"job_id": job.id})
        except JobCancelled:
            _remove_scratch(output)
            await self._finish(job, Change(expect={"running"}, to="cancelled", attempt=job.attempt))
            log.info("job cancelled", extra={"job_id": job.id})
        except JobFailed as exc:
            _remove_scratch(output)
            await self._finish(job, Change(expect={"running"}, to="failed", attempt=job.attempt, error=exc.problem))
            log.info("job failed", extra={"job_id": job.id, "problem_type": exc.problem.type})
        except JobLost as exc:
            _remove_scratch(output)
            log.info("job lost to another writer", extra={"job_id": job.id, "reason": str(exc)})
        except asyncio.CancelledError:
            # Shutdown or lost lease: hand the job back so another worker starts it afresh.
            _remove_scratch(output)
            if self._stopping.is_set():
                await self._finish(job, Change(expect={"running"}, to="queued", attempt=job.attempt, requeue=True))
                log.info("job handed back on shutdown", extra={"job_id": job.id})
            raise  # cleaned up; the cancellation still ends this task (whoever cancelled awaits it)
        except Exception:
            _remove_scratch(output)
            log.exception("job handler raised", extra={"job_id": job.id})
            problem = JOB_FAILED.problem(
                f"the {job.kind} handler stopped with an internal error; see the worker log for job {job.id}"
            )
            await self._finish(job, Change(expect={"running"}, to="failed", attempt=job.attempt, error=problem))
        finally:
            await _stop(heart)
            with contextlib.suppress(Exception):
                await message.ack()

    async def _finish(self, job: JobRow, change: Change) -> None:
        try:
            await asyncio.shield(self.store.transition(job.id, change))
        except TransitionRejected as exc:
            log.warning("transition rejected", extra={"job_id": job.id, "reason": exc.reason, "to": change.to})

    async def _heartbeat(self, job: JobRow, message: Msg, runner: asyncio.Task[None] | None) -> None:
        """Extend the lease and write heartbeats; stop the run if the job was taken away."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            with contextlib.suppress(Exception):
                await message.in_progress()
            try:
                alive = await self.store.heartbeat(job.id, job.attempt)
            except Exception as exc:
                log.warning("heartbeat failed", extra={"job_id": job.id, "error": str(exc)})
                continue
            if alive is None:
                log.info("job taken away, stopping", extra={"job_id": job.id})
                if runner is not None:
                    runner.cancel()
                return


def _remove_scratch(path: Path) -> None:
    """An attempt that did not succeed leaves no partial output behind."""
    path.unlink(missing_ok=True)


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel a helper task and wait until it has really ended (without eating our own cancellation)."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


async def run_worker(settings: Settings, stop: asyncio.Event) -> None:
    """The ``herald worker`` process body.

    Every resource and task is entered on one exit stack, so whichever step fails (the
    store, NATS, the topology, the result store), what was already started is stopped and
    awaited in reverse order: no task outlives the store it uses.
    """
    kinds = registry.load(settings)  # import every handler now: a broken one stops the worker at start, by name
    async with contextlib.AsyncExitStack() as stack:
        storage = await open_storage(settings)
        stack.push_async_callback(storage.close)
        store = storage.jobs
        store.on_commit(log_transition)
        store.on_commit(metrics().observe)
        nc = await jetstream.connect_until_ready(settings, name="herald-worker", stop=stop)
        if nc is None:
            return
        stack.push_async_callback(_drain, nc)
        # Tenants' limits as they change at run time (SPEC §12, §13).
        directory = await stack.enter_async_context(running_directory(settings, storage.tenants, nc))
        js = nc.jetstream()
        await jetstream.ensure_topology(js, settings)
        relay = Relay(store, js, sweep_interval_s=settings.sweep_interval_s)
        relay_task = asyncio.create_task(relay.run(), name="relay")
        stack.push_async_callback(_stop, relay_task)
        stack.push_async_callback(relay.publish_pending)  # runs first: what the last runs committed goes out
        subscriptions = {}
        for name in kinds:  # each kind has its own durable consumer: unserved kinds wait in JetStream
            subscription = await js.pull_subscribe_bind(worker_consumer_name(name), JOBS_STREAM)
            stack.push_async_callback(subscription.unsubscribe)
            subscriptions[name] = subscription
        worker = Worker(settings, store, await open_result_store(settings, js), kinds)
        stack.push_async_callback(worker.shutdown, settings.worker_grace_s)
        fetching = asyncio.create_task(worker.run(subscriptions, stop), name="fetch")
        stack.push_async_callback(_stop, fetching)
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
