"""The notifier's write transactions per delivered job (issue 24): a fan-out batch nobody wants
takes none, and a delivered job takes two, its fan-out (which leases it) and its outcome.

Real parts: an SQLite file, the notifier's scheduler and sender, a receiver on 127.0.0.1. The
one thing watched from outside is which transactions the notifier's ``Database`` is asked for
(a counting wrapper around ``Database.write``; the transactions themselves run as ever).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest

from herald.deliveries import Outcome
from herald.jobs import NewJob
from herald.metrics import metrics
from herald.storage.sqlite.db import Database
from herald.storage.sqlite.jobs import SqliteJobStore
from herald.storage.sqlite.queue import SqliteDeliveryQueue
from herald.storage.sqlite.schema import SCHEMA
from herald.storage.sqlite.webhooks import SqliteWebhookStore
from notifier.breaker import origin_of
from notifier.delivery import Sender
from notifier.retry import RetryPolicy
from notifier.scheduler import Scheduler
from notifier.window import CEILING, FLOOR, Windows
from schemas import JobEvent
from tests.harness import make_sealer


class _Receiver(BaseHTTPRequestHandler):
    received: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["content-length"]))
        type(self).received.append(self.headers["webhook-id"])
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[str]]]:
    handler = type("Receiver", (_Receiver,), {"received": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", handler.received
    finally:
        server.shutdown()
        server.server_close()


class _Writes:
    """The names of the transactions a Database was asked to write, in order."""

    def __init__(self, db: Database) -> None:
        self.names: list[str] = []
        write = db.write

        async def counted(fn: Callable[[Any], Any]) -> Any:
            self.names.append(fn.__qualname__.split(".")[1])  # SqliteDeliveryQueue.<method>.<locals>.tx
            return await write(fn)

        db.write = counted  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def _notifier(tmp_path: Path) -> AsyncIterator[tuple[SqliteJobStore, SqliteWebhookStore, Scheduler, _Writes]]:
    """The job and webhook stores (a gateway's), and a notifier's scheduler on its own Database."""
    gateway_db = Database(tmp_path / "herald.db", SCHEMA)
    jobs = SqliteJobStore(gateway_db, retention_s=3600, sealer=make_sealer())
    await jobs.open()
    notifier_db = Database(tmp_path / "herald.db", SCHEMA)
    await notifier_db.open()
    writes = _Writes(notifier_db)
    async with Sender(allow_private=True) as sender:
        scheduler = Scheduler(SqliteDeliveryQueue(notifier_db, make_sealer()), sender,
                              RetryPolicy(schedule=(1.0,), min_backoff_s=1.0), metrics(),
                              idle_poll_s=0.2, retention_s=3600)
        run = asyncio.create_task(scheduler.run())
        try:
            yield jobs, SqliteWebhookStore(gateway_db, make_sealer()), scheduler, writes
        finally:
            scheduler.stop()
            await run
            await notifier_db.close()
            await jobs.close()


def _events(queued: JobEvent) -> list[JobEvent]:
    """The job's three events, as an echo job's are: queued, running, succeeded."""
    return [queued] + [
        JobEvent(seq=queued.seq + n, tenant=queued.tenant, job_id=queued.job_id, kind=queued.kind,
                 version=queued.version + n, type=type, at=queued.at,
                 data=msgspec.Raw(msgspec.json.encode({"id": queued.job_id, "version": queued.version + n})))
        for n, type in ((1, "job.running"), (2, "job.succeeded"))
    ]


async def _accepted(jobs: SqliteJobStore, n: int) -> JobEvent:
    accepted = await jobs.accept(NewJob(id=f"job{n}", tenant="acme", kind="echo", collection="/echoes",
                                        params=b"{}", deadline_s=60))
    assert accepted.event is not None
    return accepted.event


async def _until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_delivered_job_takes_two_writes_and_events_nobody_wants_take_none(
    tmp_path: Path, receiver: tuple[str, list[str]]
) -> None:
    url, received = receiver
    async with _notifier(tmp_path) as (jobs, webhooks, scheduler, writes):
        await webhooks.create_endpoint("acme", url=url, event_types=["job.succeeded"], kinds=None,
                                       signature="hmac-sha256")
        await _until(lambda: "prune" in writes.names, "the scheduler's first pass")  # its retention pass
        writes.names.clear()
        for n in range(3):
            queued, running, succeeded = _events(await _accepted(jobs, n))
            # One batch per event, as on an idle notifier: the two nobody wants write nothing.
            assert await scheduler.fan_out([queued]) == 0
            assert await scheduler.fan_out([running]) == 0
            assert writes.names == [], n
            assert await scheduler.fan_out([succeeded]) == 1
            await _until(lambda: len(received) == n + 1, "the delivery")
            await _until(lambda: "finish_many" in writes.names, "the outcome's commit")
            # The fan-out leased it (no claim of its own); the outcome is the second.
            assert writes.names == ["fan_out_leasing", "finish_many"], n
            writes.names.clear()
        assert received == [f"evt_job{n}.3" for n in range(3)]


async def test_while_a_backlog_waits_the_fan_out_leases_nothing_and_the_claim_serves_it(
    tmp_path: Path, receiver: tuple[str, list[str]]
) -> None:
    """A fan-out leases only while the notifier has claimed all that was due (no backlog): then
    what it leases jumps no queue. Held back by a full claim, it records and the claim sends."""
    url, received = receiver
    async with _notifier(tmp_path) as (jobs, webhooks, scheduler, writes):
        await webhooks.create_endpoint("acme", url=url, event_types=["job.succeeded"], kinds=None,
                                       signature="hmac-sha256")
        scheduler._backlog = True  # as after a claim that filled every free slot
        succeeded = _events(await _accepted(jobs, 0))[2]
        assert await scheduler.fan_out([succeeded]) == 1
        assert writes.names[-1] == "fan_out"
        await _until(lambda: received == ["evt_job0.3"], "the delivery")
        assert "claim" in writes.names


class _Holding(BaseHTTPRequestHandler):
    """Answers after ``delay_s``, or only once released: how many requests it holds at once is
    the notifier's concurrency towards it."""

    lock = threading.Lock()
    holding = 0
    most = 0
    answered = 0
    delay_s: float | None = None  # None: until released
    release = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["content-length"]))
        cls = type(self)
        with cls.lock:
            cls.holding += 1
            cls.most = max(cls.most, cls.holding)
        cls.release.wait(30 if cls.delay_s is None else cls.delay_s)
        with cls.lock:
            cls.holding -= 1
            cls.answered += 1
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _holding(delay_s: float | None) -> Iterator[tuple[str, type[_Holding]]]:
    handler = type("Holding", (_Holding,), {"lock": threading.Lock(), "release": threading.Event(),
                                            "delay_s": delay_s})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


async def test_a_receiver_that_does_not_answer_gets_the_floor_of_attempts_at_once_and_never_more(
        tmp_path: Path) -> None:
    """A target (scheme, host, port) that has not answered gets ``FLOOR`` attempts at once from
    a notifier, never more: one dead receiver holds at most that many of its tenant's slots."""
    with _holding(None) as (url, handler):
        async with _notifier(tmp_path) as (jobs, webhooks, scheduler, _writes):
            await webhooks.create_endpoint("acme", url=url, event_types=["job.succeeded"], kinds=None,
                                           signature="hmac-sha256")
            count = FLOOR + 10
            await scheduler.fan_out([_events(await _accepted(jobs, n))[2] for n in range(count)])
            await _until(lambda: handler.holding == FLOOR, "the target's window full")
            await asyncio.sleep(0.3)  # a while for any attempt beyond the window to show (none may)
            assert handler.most == FLOOR
            handler.release.set()
            await _until(lambda: handler.answered == count, "every delivery answered")
            assert handler.most == FLOOR


async def test_a_receiver_that_answers_a_backlog_gets_a_wider_window_kept_through_a_lull(tmp_path: Path) -> None:
    """A busy receiver that answers promptly is sent more at once as it keeps up: its
    throughput is its window per round trip. Never more than ``CEILING``. The wider window
    is kept while the notifier waits for the next deliveries (between two claims nothing may
    be in flight; starting again from ``FLOOR`` each time, a window under a steady load hardly
    grew); idle since the prune before last, the target is forgotten, window and all."""
    with _holding(0.02) as (url, handler):
        async with _notifier(tmp_path) as (jobs, webhooks, scheduler, _writes):
            await webhooks.create_endpoint("acme", url=url, event_types=["job.succeeded"], kinds=None,
                                           signature="hmac-sha256")
            count = 400
            await scheduler.fan_out([_events(await _accepted(jobs, n))[2] for n in range(count)])
            await _until(lambda: handler.answered == count, "every delivery answered", timeout=60)
            assert FLOOR < handler.most <= CEILING, handler.most
            await _until(lambda: not scheduler._tasks, "nothing in flight")
            origin = origin_of(url)
            assert scheduler.windows.size(origin) > FLOOR
            scheduler._forget_idle_origins()  # the prune that finds it idle
            assert scheduler.windows.size(origin) > FLOOR
            scheduler._forget_idle_origins()  # the next one: idle since the last
            assert scheduler.windows.size(origin) == FLOOR


async def test_an_answered_attempt_frees_its_slot_while_its_outcome_is_still_being_recorded(tmp_path: Path) -> None:
    """The window bounds how many requests a receiver is asked at once. An answered attempt
    no longer loads the receiver, so its slot goes to the next delivery at once, not after
    its outcome's commit: on a busy store that commit held the slot for a write longer, and
    the webhooks of 500 jobs/s queued behind the commits (bench/RESULTS.md)."""
    with _holding(0.0) as (url, handler):
        async with _notifier(tmp_path) as (jobs, webhooks, scheduler, _writes):
            await webhooks.create_endpoint("acme", url=url, event_types=["job.succeeded"], kinds=None,
                                           signature="hmac-sha256")
            commits = asyncio.Event()  # the store records no outcome until set: a busy store
            finish_many = scheduler.queue.finish_many

            async def held(attempts: Any, owner: str) -> Any:
                await commits.wait()
                return await finish_many(attempts, owner)

            scheduler.queue.finish_many = held  # type: ignore[method-assign]
            count = CEILING + FLOOR  # more than the widest window: slots held until the commit run out
            try:
                await scheduler.fan_out([_events(await _accepted(jobs, n))[2] for n in range(count)])
                await _until(lambda: handler.answered == count, "every delivery answered, no outcome recorded yet",
                             timeout=10)
                assert handler.most <= CEILING
            finally:
                commits.set()
            await _until(lambda: not scheduler._tasks, "every outcome recorded")


def test_a_window_grows_while_full_and_answered_and_halves_when_its_target_struggles() -> None:
    windows, origin = Windows(), "https://hooks.example:443"
    answered, refused = Outcome(status_code=204, latency_s=0.01), Outcome(status_code=None, latency_s=15, timed_out=True)
    for _ in range(12):
        windows.ended(origin, answered, was_full=True)
    assert windows.size(origin) == FLOOR + 12
    windows.ended(origin, answered, was_full=False)  # room to spare: no reason to grow
    windows.ended(origin, Outcome(status_code=404, latency_s=0.01), was_full=True)  # the receiver's say, not its load
    assert windows.size(origin) == FLOOR + 12
    windows.ended(origin, Outcome(status_code=503, latency_s=0.01), was_full=True)
    assert windows.size(origin) == (FLOOR + 12) // 2
    windows.ended(origin, refused, was_full=True)
    windows.ended(origin, refused, was_full=True)
    assert windows.size(origin) == FLOOR  # never below
    for _ in range(100):
        windows.ended(origin, answered, was_full=True)
    assert windows.size(origin) == CEILING


async def test_targets_sharing_one_receiver_share_its_window_and_are_not_leased_past_it(tmp_path: Path) -> None:
    """Six tenants' endpoints on one receiver: six delivery targets, one origin (scheme, host,
    port) and one window. The claim counts room per target; the notifier gives each busy
    target its part of the origin's free window, so a claim leases about what can be sent
    now. Counting each target's room against the whole window leased up to six windows a
    claim and handed back all but one, a write each time."""
    tenants = [f"t{n}" for n in range(6)]
    per_tenant = 60
    # Each answer held 50 ms, so the targets stay busy between claims: a claim that finds its
    # origin with nothing in flight may give any target the whole window (the target with work
    # may be any of them), and with 10 ms answers a loaded machine saw three such claims.
    with _holding(0.05) as (url, handler):
        async with _notifier(tmp_path) as (jobs, webhooks, scheduler, _writes):
            handed_back: list[int] = []
            release = scheduler.queue.release

            async def counted(ids: Any, owner: str) -> None:
                handed_back.append(len(ids))
                await release(ids, owner)

            scheduler.queue.release = counted  # type: ignore[method-assign]
            events = []
            for tenant in tenants:
                await webhooks.create_endpoint(tenant, url=f"{url}/{tenant}", event_types=["job.succeeded"],
                                               kinds=None, signature="hmac-sha256")
                for n in range(per_tenant):
                    accepted = await jobs.accept(NewJob(id=f"{tenant}-{n}", tenant=tenant, kind="echo",
                                                        collection="/echoes", params=b"{}", deadline_s=60))
                    assert accepted.event is not None
                    events.append(_events(accepted.event)[2])
            await scheduler.fan_out(events)
            await _until(lambda: handler.answered == len(events), "every delivery answered", timeout=60)
            assert handler.most <= CEILING
            # The first claims find the origin with nothing in flight, so any target may take the
            # whole window (any of them may be the one with work): up to one window per target
            # leased, all but what is sent handed back. Once targets are busy, each claim leases
            # about what the shared window can send now, and hands back little.
            warm_up, busy = handed_back[:2], handed_back[2:]
            assert all(n <= len(tenants) * CEILING for n in warm_up), handed_back[:20]
            # A loaded machine sees a few more claims meet an idle origin (19 of 360 under the whole
            # suite at load 7); the old count handed back up to five windows a claim, hundreds in all.
            assert sum(busy) <= len(events) // 10, (sum(busy), handed_back[:20])


async def test_one_target_with_work_gets_the_whole_window_while_its_receivers_other_targets_idle(
        tmp_path: Path) -> None:
    """Ten tenants' endpoints on one receiver, known to the notifier and idle; then one tenant
    has a backlog. Nothing is in flight there, so that one target may take the whole window at
    once: shared over the ten known targets, it got one slot or none a claim, and its backlog
    trickled out at a claim per idle poll."""
    tenants = [f"t{n}" for n in range(10)]
    # Each answer held 50 ms: long enough that a window's worth are in the receiver at once
    # even when the machine is loaded and the notifier sends them more slowly.
    with _holding(0.05) as (url, handler):
        async with _notifier(tmp_path) as (jobs, webhooks, scheduler, _writes):
            for tenant in tenants:
                await webhooks.create_endpoint(tenant, url=f"{url}/{tenant}", event_types=["job.succeeded"],
                                               kinds=None, signature="hmac-sha256")

            async def succeeded(tenant: str, n: int) -> JobEvent:
                accepted = await jobs.accept(NewJob(id=f"{tenant}-{n}", tenant=tenant, kind="echo",
                                                    collection="/echoes", params=b"{}", deadline_s=60))
                assert accepted.event is not None
                return _events(accepted.event)[2]

            await scheduler.fan_out([await succeeded(tenant, 0) for tenant in tenants])
            await _until(lambda: handler.answered == len(tenants), "one delivery to each target")
            await _until(lambda: not scheduler._tasks, "nothing in flight")
            backlog = [await succeeded("t3", n) for n in range(1, 101)]
            scheduler._backlog = True  # as after a claim that filled every free slot: the claim serves them
            await scheduler.fan_out(backlog)
            # at 8 or more at once, 50 ms each, 100 take well under a second; a claim per
            # idle poll (0.2 s) of a slot or two would take 10 s and more
            await _until(lambda: handler.answered == len(tenants) + len(backlog), "the backlog delivered", timeout=5)
            assert handler.most >= FLOOR
