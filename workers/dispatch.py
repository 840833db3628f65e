"""Fair dispatch among tenants (SPEC §13): which tenant's job a free slot takes next.

Work messages live on ``jobs.<kind>.<tenant token>``, one durable pull consumer per kind
and tenant (``herald.jetstream.worker_consumer``), made when first needed. A worker never
fetches "the next job of the kind": for each free slot it picks a tenant, then asks that
tenant's consumer for one message. So a tenant with a backlog of thousands holds only the
slots its turns give it, and another tenant's new job waits about one run, not the backlog.

* **Who has work.** Every ``REFRESH_S`` a worker reads the stream's message count per
  subject (one ``STREAM.INFO`` with a subject filter; the counts include messages being run,
  which are acknowledged only when their run ends). Between reads, a core subscription to
  its kinds' work subjects hears every publish, so a new job is fetched at once. A tenant
  whose consumer answers "no messages" (its messages are all running elsewhere) is asked
  again when its count grows, when a new message is heard, or after ``REPROBE_S`` (a
  redelivery after a dead worker's lease shows no new count).
* **Who goes next.** Each tenant has a usage: the slot-seconds it was given, decaying with a
  half-life of ``HALF_LIFE_S``. A start charges the kind's average run time, its end
  corrects that to the run's real length. A free slot goes to the tenant with work and the
  least usage, the longest unserved on a tie: at equal load that is round robin, and a
  tenant of long jobs gets fewer starts, not more slot time. A tenant that gets work after
  having none here (a newcomer, or one back after a pause) is placed as a scheduler places
  a task that wakes up: its usage is raised, if lower, to ``HEAD_START_RUNS`` runs below the
  least used tenant at work, so it gets a start or two ahead and then takes turns. Without
  that, a flood that had just begun (no usage yet) took every free slot until its usage
  caught up with that of a tenant that had been running for a while, whose new jobs then
  waited seconds (bench/RESULTS.md, issue 21); and a newcomer beside a flood took every
  slot until it had caught up with the flood's past. Within a tenant, its consumer hands
  out messages in stream order (accept order). Usage is per worker process; every process
  shares its own slots this way, so the deployment's slots are shared the same way
  (SPEC §13: per deployment, not per process).
* **max_running.** A capped tenant's consumers have ``max_ack_pending`` = its cap, so NATS
  itself hands no more of its jobs of a kind to all workers together than it may run; the
  claim (``Change.max_running``) counts in the store across kinds. No store lock is taken
  to dispatch; a capped tenant's claim takes one row lock.
* **Older messages.** ``jobs.<kind>`` (published by an older Herald, or by an older gateway
  during a rolling upgrade) is drained through the kind's consumer of old,
  ``herald-workers-<kind>``, as if it were one more tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from herald import jetstream
from herald.constants import JOB_SUBJECTS, JOBS_STREAM, tenant_from_token, worker_consumer_name
from herald.kinds import KindDeclaration
from herald.settings import Settings
from herald.tenants import LimitsSource

log = logging.getLogger("herald.worker")

REFRESH_S = 0.5  # how often each worker reads the per-tenant message counts
REPROBE_S = 1.0  # a tenant that had nothing to hand out is asked again after this at the latest
HINT_RETRY_S = 0.02  # a message heard on the wire may not be stored yet (a cluster commits first)
HALF_LIFE_S = 10.0  # how fast a tenant's past use fades
HEAD_START_RUNS = 2  # a tenant that gets work after none starts this many runs below the least used one at work
PRESENT_S = 1.0  # a tenant charged this recently is still at work here (between two of its jobs)
REQUEST_TIMEOUT_S = 2.0
LEGACY = None  # the token of ``jobs.<kind>``, an older Herald's subject


@dataclass(eq=False)
class TenantQueue:
    """One tenant's work of one kind, as this worker sees it."""

    token: str | None  # None: the older ``jobs.<kind>`` subject
    tenant: str | None
    count: int = 0  # messages on its subject at the last read (+ heard since)
    probe_after: float = 0.0
    heard_at: float = -1e9
    usage: float = 0.0  # decaying slot-seconds
    usage_at: float = 0.0
    last_start: float = 0.0
    running: int = 0  # this process's runs of it
    taking: bool = False  # a pull request is out
    consumer_cap: int | None = None  # the max_running its consumer was made with (None: not made yet)
    inbox: Inbox | None = None

    def decayed(self, now: float) -> float:
        return self.usage * 0.5 ** ((now - self.usage_at) / HALF_LIFE_S)

    def charge(self, seconds: float, now: float) -> None:
        self.usage, self.usage_at = max(0.0, self.decayed(now) + seconds), now

    def at_work(self, now: float) -> bool:
        """It has work, runs here, or ran here a moment ago (a steady tenant between two jobs)."""
        return self.count > 0 or self.running > 0 or now - self.usage_at < PRESENT_S


class Inbox:
    """The answers to one consumer's pull requests (``no_wait``), one request at a time.

    JetStream delivers a pulled message under its own subject, so answers are told apart by
    subscription: each consumer this worker pulls from has its inbox. A message that comes
    after its request gave up waits here for the next request."""

    def __init__(self, nc: NATS, consumer: str) -> None:
        self._nc = nc
        self.consumer = consumer
        self._subject = nc.new_inbox()
        self._answers: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub: object | None = None

    async def _arrived(self, msg: Msg) -> None:
        self._answers.put_nowait(msg)

    async def take(self, batch: int) -> tuple[list[Msg], str | None]:
        """Up to ``batch`` messages the consumer has now, and the status that ended the answer
        (``"404"``: no more; ``"409"``: at max_ack_pending; ``"timeout"``: no answer; None: all came)."""
        if self._sub is None:
            self._sub = await self._nc.subscribe(self._subject, cb=self._arrived)
        messages: list[Msg] = []
        while not self._answers.empty():  # late answers to an earlier request
            msg = self._answers.get_nowait()
            if not JetStreamContext.is_status_msg(msg):
                messages.append(msg)
        if len(messages) >= batch:
            return messages, None
        status: str | None = None
        await self._nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{JOBS_STREAM}.{self.consumer}",
            json.dumps({"batch": batch - len(messages), "no_wait": True}).encode(),
            reply=self._subject,
        )
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        try:
            while len(messages) < batch:
                msg = await asyncio.wait_for(self._answers.get(), timeout=max(0.001, deadline - time.monotonic()))
                status = JetStreamContext.is_status_msg(msg)
                if status:
                    break
                messages.append(msg)
        except (TimeoutError, asyncio.TimeoutError):
            status = "timeout"
        return messages, status

    async def close(self) -> None:
        """Stop listening; hand back what came too late (another worker takes it at once)."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()  # type: ignore[attr-defined]
            self._sub = None
        while not self._answers.empty():
            msg = self._answers.get_nowait()
            if not JetStreamContext.is_status_msg(msg) and msg.reply:
                with contextlib.suppress(Exception):
                    await msg.nak()


@dataclass(eq=False)
class KindQueue:
    """The tenants with work of one kind, and the choice of who goes next."""

    kind: KindDeclaration
    settings: Settings
    js: JetStreamContext
    nc: NATS
    limits: LimitsSource
    tenants: dict[str | None, TenantQueue] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    average_run_s: float = 1.0  # what a start is charged before its real length is known

    def queue(self, token: str | None) -> TenantQueue:
        queue = self.tenants.get(token)
        if queue is None:
            queue = self.tenants[token] = TenantQueue(token, None if token is None else tenant_from_token(token))
        return queue

    def counted(self, counts: dict[str | None, int]) -> None:
        """The message counts per tenant just read from the stream."""
        for token, queue in list(self.tenants.items()):
            if token not in counts:
                queue.count = 0
                if queue.running == 0 and queue.decayed(time.monotonic()) < 0.01 and not queue.taking:
                    del self.tenants[token]  # forgotten: idle, and its use has faded
                    if queue.inbox is not None:
                        asyncio.ensure_future(queue.inbox.close())
        now = time.monotonic()
        for token, count in counts.items():
            queue = self.queue(token)
            if count > queue.count:
                self._arrives(queue, now)
                queue.probe_after = 0.0
            queue.count = count
        if self.ready():
            self.wake.set()

    def heard(self, token: str | None) -> None:
        """A work message was published for this tenant."""
        queue = self.queue(token)
        now = time.monotonic()
        self._arrives(queue, now)
        queue.count += 1
        queue.probe_after = 0.0
        queue.heard_at = now
        self.wake.set()

    def _arrives(self, queue: TenantQueue, now: float) -> None:
        """``queue`` has work now: if it had none (and ran nothing lately), its usage is raised to
        ``HEAD_START_RUNS`` runs below the least used tenant at work, if it was lower (see the
        module's "Who goes next")."""
        if queue.at_work(now):
            return
        others = [q.decayed(now) for q in self.tenants.values() if q is not queue and q.at_work(now)]
        if others:
            floor = min(others) - HEAD_START_RUNS * self.average_run_s
            if queue.decayed(now) < floor:
                queue.usage, queue.usage_at = floor, now

    def ready(self) -> bool:
        now = time.monotonic()
        return any(q.count > 0 and q.probe_after <= now for q in self.tenants.values())

    def next_probe_in(self) -> float:
        now = time.monotonic()
        waits = [q.probe_after - now for q in self.tenants.values() if q.count > 0]
        return max(0.0, min(waits, default=REFRESH_S))

    def choose(self, slots: int) -> list[TenantQueue]:
        """Who gets each of ``slots`` free slots: the least used tenant with work, each time."""
        now = time.monotonic()
        candidates = [q for q in self.tenants.values() if q.count > 0 and q.probe_after <= now]
        picks: list[TenantQueue] = []
        extra: dict[TenantQueue, int] = {}
        while candidates and len(picks) < slots:
            best = min(candidates, key=lambda q: (q.decayed(now) + extra.get(q, 0) * self.average_run_s,
                                                   q.last_start))
            picks.append(best)
            extra[best] = extra.get(best, 0) + 1
            if extra[best] >= best.count:
                candidates.remove(best)
        return picks

    async def take(self, queue: TenantQueue, batch: int) -> list[Msg]:
        """Up to ``batch`` of the tenant's messages (fewer when it has fewer to hand out now)."""
        cap = 0 if queue.tenant is None else self.limits.limits(queue.tenant).max_running
        if queue.consumer_cap != cap:  # first use, or its max_running changed
            config = jetstream.worker_consumer(self.settings, self.kind, queue.token, cap)
            await jetstream.ensure_consumer(self.js, config)
            queue.consumer_cap = cap
        if queue.inbox is None:
            queue.inbox = Inbox(self.nc, worker_consumer_name(self.kind.name, queue.token))
        queue.taking = True
        asked = time.monotonic()
        try:
            messages, status = await queue.inbox.take(batch)
        finally:
            queue.taking = False
        now = time.monotonic()
        if len(messages) < batch:
            if status == "timeout":
                queue.consumer_cap = None  # removed while idle? made again next time
            if queue.heard_at >= asked:
                # A message was published while the request was out: ask again at the next free
                # slot (holding the tenant back here would undo the hint; seen in the noisy bench).
                queue.probe_after = 0.0
            else:
                recently_heard = now - queue.heard_at < 0.5 and status == "404"
                queue.probe_after = now + (HINT_RETRY_S if recently_heard else REPROBE_S)
        for _ in messages:
            queue.charge(self.average_run_s, now)
            queue.last_start = now
            queue.running += 1
        return messages

    def finished(self, queue: TenantQueue, run_s: float) -> None:
        """One of the tenant's runs ended after ``run_s``: its charge becomes the real length."""
        now = time.monotonic()
        queue.running -= 1
        queue.charge(run_s - self.average_run_s, now)
        self.average_run_s += 0.1 * (run_s - self.average_run_s)
        if queue.consumer_cap:  # its consumer has room again (max_ack_pending)
            queue.probe_after = 0.0
        self.wake.set()


def token_of(subject: str, kind: str) -> tuple[bool, str | None]:
    """(is it this kind's work subject, the tenant token in it: None for ``jobs.<kind>``)."""
    parts = subject.split(".")
    if len(parts) < 2 or parts[0] != "jobs" or parts[1] != kind:
        return False, None
    if len(parts) == 2:
        return True, LEGACY
    return (True, parts[2]) if len(parts) == 3 else (False, None)


class Dispatch:
    """The per-kind queues of one worker, kept up to date from the stream and the wire."""

    def __init__(self, nc: NATS, js: JetStreamContext, settings: Settings, kinds: Iterable[KindDeclaration],
                 limits: LimitsSource) -> None:
        self.nc = nc
        self.js = js
        self.kinds = {kind.name: KindQueue(kind, settings, js, nc, limits) for kind in kinds}
        self._subs: list[object] = []

    async def start(self) -> None:
        for name in self.kinds:
            for subject in (f"jobs.{name}", f"jobs.{name}.*"):
                self._subs.append(await self.nc.subscribe(subject, cb=self._heard))
        await self.refresh()

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]
        for queue in self.kinds.values():
            for tenant in queue.tenants.values():
                if tenant.inbox is not None:
                    await tenant.inbox.close()

    async def _heard(self, msg: Msg) -> None:
        name = msg.subject.split(".")[1]
        queue = self.kinds.get(name)
        if queue is not None:
            _ok, token = token_of(msg.subject, name)
            queue.heard(token)

    async def refresh(self) -> None:
        """Read the message count of every work subject (one request) and tell each kind."""
        info = await self.js.stream_info(JOBS_STREAM, subjects_filter=JOB_SUBJECTS)
        counts: dict[str, dict[str | None, int]] = {name: {} for name in self.kinds}
        for subject, count in (info.state.subjects or {}).items():
            name = subject.split(".")[1] if subject.count(".") >= 1 else ""
            if name in counts:
                ok, token = token_of(subject, name)
                if ok and count > 0:
                    counts[name][token] = count
        for name, queue in self.kinds.items():
            queue.counted(counts[name])

    async def run_refresh(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=REFRESH_S)
            try:
                await self.refresh()
            except Exception as exc:  # NATS reconnecting: the next read will do
                log.debug("work counts not read: %s", exc)
