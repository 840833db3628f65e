"""The delivery loop of one notifier process: claim due deliveries, send them, record the outcome.

Work is bounded three ways, so that one tenant's slow or dead receivers never become
another tenant's outage (SPEC §13): at most ``MAX_IN_FLIGHT`` attempts per process, at
most ``PER_TENANT`` of them for one tenant, and per target (scheme, host and port:
``notifier.breaker.origin_of``) at most its window, 8 to 32 as it answers (``notifier.window``). The claim gives free slots to the tenant
with the fewest in flight first, and within a tenant rotates over its targets
(``DeliveryQueue.claim``). A target that gets no answer again and again is paced by the
circuit breaker (``notifier.breaker``): one probe in flight, the rest rescheduled without
an attempt. The loop sleeps until the next delivery is due, until the fan-out or a
finished attempt wakes it, or at most ``idle_poll_s`` (other processes' work: a retry
requested through the API, a lease left behind by a killed notifier).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from urllib.parse import urlsplit

from opentelemetry.trace import Span, StatusCode

from herald import tracing
from herald.jobs import StoreUnavailable
from herald.logs import log_event
from herald.metrics import Metrics
from herald.timefmt import now
from notifier.breaker import Breaker, origin_of
from notifier.delivery import SUCCESS_WITHIN_S, Sender
from herald.deliveries import Attempted, Claimed, Finished, LeaseOffer, Outcome
from herald.storage.ports import DeliveryQueue
from notifier.notices import Notices
from notifier.recorder import Recorder
from notifier.retry import RetryPolicy
from notifier.window import FLOOR, Windows
from herald.webhook_signing import signature_header
from schemas import JobEvent

log = logging.getLogger("herald.notifier")

# Slots are cheap (a waiting coroutine and a socket); what protects tenants from each other is
# the share: one tenant alone may use PER_TENANT (what the whole process had before fair
# sharing, so a single tenant's rate is unchanged), and three more such tenants still find free
# slots. The claim's water-filling hands those out to the least-served tenant first.
MAX_IN_FLIGHT = 256
PER_TENANT = 64
PER_TARGET = FLOOR  # what the claim may lease per delivery target; a wider window adds room
# A lease is renewed every RENEW_EVERY_S while its attempt is in flight (sending, or its
# outcome waiting to be recorded), so it need not outlast the longest attempt
# (SUCCESS_WITHIN_S): a notifier that dies (kill -9, its machine lost) holds its deliveries
# that much, where a lease as long as an attempt kept them 30 s. Renewals that fail (the
# store away) let it run out; the attempt's record is then fenced off, and the delivery is
# sent again by whoever leases it next, as at-least-once allows.
LEASE_S = 10.0
RENEW_EVERY_S = 2.5
PRUNE_EVERY_S = 60.0
SHUTDOWN_GRACE_S = 5.0
# An outcome the store could not take (StoreUnavailable: PostgreSQL restarting, failing over, a
# connection cut mid-statement) is recorded again after this, doubling up to 2 s.
RECORD_RETRY_FIRST_S = 0.1
RECORD_RETRY_MAX_S = 2.0


class Scheduler:
    def __init__(
        self,
        queue: DeliveryQueue,
        sender: Sender,
        policy: RetryPolicy,
        metrics: Metrics,
        *,
        idle_poll_s: float,
        retention_s: float,
        notices: Notices | None = None,
        pause_s: float = 5.0,
    ) -> None:
        self.queue = queue
        self.notices = notices
        self.sender = sender
        self.policy = policy
        self.metrics = metrics
        self.idle_poll_s = idle_poll_s
        self.retention_s = retention_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Outcomes are committed in batches; an attempt's slot is freed when its target answers
        # (``_answered``), the attempt is done (its task ends) only after its commit.
        self.recorder = Recorder(queue, self.owner)
        self._rng = random.Random()
        self._wake = asyncio.Event()
        self._waiting = asyncio.Event()  # a fan-out put events to wait for their tenant's share
        self._stopping = False
        self._tasks: dict[asyncio.Task[None], Claimed] = {}
        self._in_flight: Counter[str] = Counter()  # per delivery target (endpoint id or callback URL)
        self._origin_in_flight: Counter[str] = Counter()  # per target as SPEC §13 means it: scheme, host, port
        self._tenant_in_flight: Counter[str] = Counter()
        self._answered_ids: set[str] = set()  # attempts answered, their outcome not yet recorded
        # Which delivery targets each origin has (learnt from what was claimed), so that the claim
        # can leave out an origin that is full or paced, give its targets their part of its
        # window, and pacing can reschedule all of it. Kept while the origin is idle, so that
        # its targets are not first met again by the next claim, each with a window of its own
        # (``_forget_idle_origins``).
        self._targets_of: dict[str, set[str]] = {}
        self._idle_origins: set[str] = set()  # idle at the last prune: forgotten at the next one
        self.breaker = Breaker(pause_s)
        self.windows = Windows()
        self._turn = 0  # which of an origin's busy targets the odd free slots of its window go to next
        self._backlog = False  # the last claim filled every free slot
        self._claiming = asyncio.Lock()  # a claim and a fan-out that leases take turns
        self._renewed_at = 0.0  # monotonic: when the last renewal that succeeded was sent

    def kick(self) -> None:
        """New deliveries were recorded, or a slot came free: look again now."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._waiting.set()

    async def run(self) -> None:
        """Deliver until ``stop()``; then let attempts in flight finish briefly and hand back the rest."""
        next_prune = time.monotonic()
        renewing = asyncio.create_task(self._renew_leases(), name="webhook-lease-renewal")
        try:
            while not self._stopping:
                self._wake.clear()
                try:
                    await self._claim_and_start()
                    if time.monotonic() >= next_prune:
                        next_prune = time.monotonic() + PRUNE_EVERY_S
                        self._forget_idle_origins()
                        await self.queue.prune(now() - self.retention_s)
                    if self._wake.is_set():
                        continue  # attempts ended or deliveries came while claiming: claim again now
                    sleep_s = await self._sleep_s()
                except Exception as exc:  # the store is busy or away: what is due stays due
                    log.warning("webhook scheduler pass failed, will retry: %s", exc)
                    sleep_s = self.idle_poll_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=sleep_s)
        finally:
            try:
                await self._shutdown()
            finally:
                renewing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renewing

    async def _renew_leases(self) -> None:
        """Every RENEW_EVERY_S, extend the lease of every delivery whose attempt is in flight."""
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            ids = [item.delivery.id for item in self._tasks.values()]
            if not ids:
                continue
            sent = time.monotonic()
            try:
                await self.queue.renew(ids, self.owner, LEASE_S)
            except Exception as exc:  # the store is away: the leases run out, as a dead notifier's do
                log.warning("renewing webhook leases failed: %s", exc)
                continue
            self._renewed_at = sent

    async def fan_out(self, events: Sequence[JobEvent]) -> int:
        """Record the deliveries of committed ``events`` (the fan-out); returns how many are pending.

        While this notifier holds no backlog (its last claim took everything due that it
        could), the same transaction leases what is due at once to it, within the same
        caps as a claim: a delivered job then costs two write transactions here, the
        fan-out and its outcome, not three. Fan-out and claim take turns, so neither leases
        on counts of slots the other is filling."""
        async with self._claiming:
            offer = self._offer()
            if offer is None:
                result = await self.queue.fan_out(events)
                pending, claimed = result.pending, result.claimed
            else:
                result = await self.queue.fan_out_leasing(events, offer)
                pending, claimed = result.pending, result.claimed
                self._backlog = len(claimed) >= offer.limit
                try:
                    await self._start(claimed)
                except Exception as exc:  # the fan-out stands (its events are acked): a lease not
                    # handed back or deferred runs out and the delivery is claimed again
                    log.warning("handing back deliveries the fan-out leased failed: %s", exc)
        if pending > len(claimed) and self._claim_would_find_more(events, offer is not None):
            self.kick()
        if result.waiting:
            self._waiting.set()
        return pending

    async def drain_waiting(self) -> None:
        """Until ``stop()``: fan out the events that wait for their tenant's share
        (``DeliveryQueue.drain_waiting``), pass after pass while there are any. Woken by a
        fan-out that put events to wait; every ``idle_poll_s`` it looks anyway (another
        notifier's, or a stopped one's)."""
        after: str | None = None  # the last tenant drained: the next pass starts after it
        while not self._stopping:
            self._waiting.clear()
            try:
                drained = await self.queue.drain_waiting(after)
            except Exception as exc:  # the store is busy or away: the events keep waiting
                log.warning("fanning out waiting job events failed, will retry: %s", exc)
                drained = None
            if drained is not None and drained.events:
                after = drained.last_tenant
                if drained.pending:
                    self.kick()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._waiting.wait(), timeout=self.idle_poll_s)

    def _claim_would_find_more(self, events: Sequence[JobEvent], offered: bool) -> bool:
        """Whether the deliveries a fan-out left pending need a claim pass now. Those a leasing
        fan-out left were held back by a cap (a slot that frees wakes the claim), by an older
        version in flight (its end wakes it) or waiting (scheduled), or are not due yet (a
        progress slot: the claim pass learns when); or the offer's slots ran out (a backlog)."""
        return (not offered or self._backlog or not self._tasks
                or any(event.type == "job.progress" for event in events))

    def _offer(self) -> LeaseOffer | None:
        free = MAX_IN_FLIGHT - len(self._tasks)
        if self._stopping or self._backlog or free <= 0:
            return None
        return LeaseOffer(owner=self.owner, lease_s=LEASE_S, per_target=PER_TARGET, limit=free,
                          in_flight=self._claim_in_flight(), per_tenant=PER_TENANT,
                          tenant_in_flight=dict(self._tenant_in_flight), held=self._held())

    async def _claim_and_start(self) -> None:
        async with self._claiming:
            free = MAX_IN_FLIGHT - len(self._tasks)
            if free <= 0:
                return
            # The cheap "anything due?" read spares an idle notifier a write transaction per pass;
            # while the last claim got all it asked for there is a backlog, and it would only add
            # a round trip before each claim.
            if not self._backlog and not await self.queue.anything_due(self._held()):
                return
            claimed = await self.queue.claim(
                self.owner, lease_s=LEASE_S, per_target=PER_TARGET, limit=free, in_flight=self._claim_in_flight(),
                per_tenant=PER_TENANT, tenant_in_flight=dict(self._tenant_in_flight), held=self._held(),
            )
            self._backlog = len(claimed) >= free
            await self._start(claimed)

    async def _start(self, claimed: Sequence[Claimed]) -> None:
        """Send what was leased to this notifier, but what its target's origin has no slot for or
        the breaker paces: that is handed back or rescheduled."""
        if self._stopping and claimed:  # leased by a fan-out that ended after stop(): not sent here
            await self.queue.release([item.delivery.id for item in claimed], self.owner)
            return
        deferred: dict[str, tuple[float, list[str]]] = {}  # origin -> (delay, delivery ids)
        released: list[str] = []
        for item in claimed:
            origin = origin_of(item.url)
            self._targets_of.setdefault(origin, set()).add(item.delivery.target)
            if self._origin_in_flight[origin] >= self.windows.size(origin):
                released.append(item.delivery.id)  # full (a target first met in this claim): held from now on
                continue
            admission = self.breaker.admit(origin)
            if not admission.send:
                _delay, ids = deferred.setdefault(origin, (admission.defer_s, []))
                ids.append(item.delivery.id)
                continue
            task = asyncio.create_task(self._attempt(item, origin, admission.probe, item.trace_context),
                                       name=f"webhook-{item.delivery.id}")
            self._tasks[task] = item
            self._in_flight[item.delivery.target] += 1
            self._origin_in_flight[origin] += 1
            self._tenant_in_flight[item.delivery.tenant] += 1
            task.add_done_callback(self._done)
        if released:
            await self.queue.release(released, self.owner)
        for delay, ids in deferred.values():
            # Paced: rescheduled, not attempted (no attempt is counted, SPEC §13).
            await self.queue.defer(ids, self.owner, [], delay)
            self.metrics.webhook_deliveries.labels(outcome="paced").inc(len(ids))

    def _claim_in_flight(self) -> dict[str, int]:
        """What the claim should count in flight per delivery target, against ``PER_TARGET``.

        The window is per origin (scheme, host, port); the claim counts room per delivery
        target, and one origin can be the target of many (every tenant's endpoint on one
        receiver). So each known target is given its part of its origin's free window: the
        targets with attempts in flight share it evenly (the odd slots go round them in turn),
        a known target with none gets one; with none in flight at all, each known target may
        take the whole window (sharing it then could leave the one target with work no room
        at all). A target counted below zero gets more room than ``PER_TARGET``
        (a wide window). Counting each target's room against the whole window, a claim
        leased up to a window per target and handed all but one back. A target first met in
        a claim gets ``PER_TARGET``, the floor of every window."""
        counts = dict(self._in_flight)
        for origin, targets in self._targets_of.items():
            free = self.windows.size(origin) - self._origin_in_flight[origin]
            if free <= 0:
                continue  # held: the claim leaves its targets out
            busy = sorted(target for target in targets if self._in_flight[target] > 0)
            if not busy:  # nothing in flight there: any of its targets may be the one with work
                for target in targets:
                    counts[target] = PER_TARGET - free
                continue
            for target in targets:
                counts[target] = PER_TARGET - 1
            share, rest = divmod(free, len(busy))
            first = self._turn % len(busy)  # fewer free slots than busy targets: they take turns
            self._turn += rest
            for n, target in enumerate(busy[first:] + busy[:first]):
                counts[target] = PER_TARGET - share - (n < rest)
        return counts

    def _forget_idle_origins(self) -> None:
        """Origins with nothing in flight and no pause since the last prune (one to two
        ``PRUNE_EVERY_S`` ago) are forgotten: learnt again when next claimed."""
        idle = {origin for origin in self._targets_of
                if origin not in self._origin_in_flight and not self.breaker.paced(origin)}
        for origin in idle & self._idle_origins:
            del self._targets_of[origin]
            self.windows.forget(origin)
        self._idle_origins = idle - self._idle_origins

    def _held(self) -> list[str]:
        """Delivery targets the claim should leave out: their origin is full here, or paced."""
        held: list[str] = []
        for origin, targets in self._targets_of.items():
            if self._origin_in_flight[origin] >= self.windows.size(origin) or self.breaker.holding(origin):
                held.extend(targets)
        return held

    def _answered(self, item: Claimed, origin: str) -> None:
        """The target answered (or never will): its slot is free for the next attempt now, though
        the outcome is still being recorded. The window bounds what a receiver is asked at once;
        the commit that follows does not load it, and held the slot a store write longer."""
        if item.delivery.id in self._answered_ids:
            return
        self._answered_ids.add(item.delivery.id)
        for counter, key in ((self._in_flight, item.delivery.target), (self._origin_in_flight, origin),
                             (self._tenant_in_flight, item.delivery.tenant)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]
        self._wake.set()

    def _done(self, task: asyncio.Task[None]) -> None:
        item = self._tasks.pop(task)
        self._answered(item, origin_of(item.url))  # a crashed or cancelled attempt frees its slot here
        self._answered_ids.discard(item.delivery.id)
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook attempt crashed", exc_info=task.exception(),
                      extra={"job_id": item.delivery.job_id, "endpoint_id": item.delivery.endpoint_id})
        self._wake.set()

    async def _sleep_s(self) -> float:
        # Only how long to sleep, capped at idle_poll_s: a skew between this machine's clock
        # and the store's costs at most that much delay; due-ness itself is judged by the store.
        ts = now()
        due = await self.queue.next_due_after(ts)
        return self.idle_poll_s if due is None else max(0.0, min(self.idle_poll_s, due - ts))

    async def _attempt(self, item: Claimed, origin: str, probe: bool,
                       trace_context: tuple[str, str | None] | None = None) -> None:
        """One attempt as a span of the job's trace; the request's ``traceparent`` is that span's."""
        parent = tracing.context_from(*trace_context) if trace_context is not None else None
        if parent is None:
            await self._send(item, origin, probe)
            return
        with tracing.span("webhook delivery", parent, kind=tracing.SpanKind.CLIENT) as span:
            await self._send(item, origin, probe, span)

    async def _pace(self, origin: str, outcome: Outcome, probe: bool) -> None:
        """Tell the breaker how the target did; if that paced it, reschedule all of it that is due,
        so that no notifier sends it anything before the pause ends."""
        pause = self.breaker.record(origin, answered=outcome.status_code is not None,
                                    unreachable=outcome.unreachable, probe=probe)
        if pause is None:
            return
        log.warning("webhook target paced", extra={"target": origin, "pause_s": pause, "probe_failed": probe})
        try:
            await self.queue.defer([], self.owner, sorted(self._targets_of.get(origin, ())), pause)
        except Exception as exc:  # the store is busy: this notifier still holds the target back
            log.warning("rescheduling a paced target's deliveries failed: %s", exc)

    async def _send(self, item: Claimed, origin: str, probe: bool, span: Span | None = None) -> None:
        d = item.delivery
        context = {"job_id": d.job_id, "endpoint_id": d.endpoint_id, "delivery_id": d.id, "event_id": d.event_id,
                   "attempt": d.attempts + 1}
        timestamp = int(time.time())
        headers = {
            "webhook-id": d.event_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature_header(item.keys, d.event_id, timestamp, item.body),
        }
        if span is not None:
            tracing.inject(headers)
        started_at = now()
        leased_until = time.monotonic() + LEASE_S
        outcome = await self.sender.send(item.url, item.body, headers)
        self.windows.ended(origin, outcome, was_full=self._origin_in_flight[origin] >= self.windows.size(origin))
        self._answered(item, origin)
        await self._pace(origin, outcome, probe)
        plan = self.policy.plan(outcome, d.attempts + 1, self._rng)
        finished = await self._record(Attempted(claimed=item, started_at=started_at, outcome=outcome, plan=plan),
                                      leased_until)
        if self.notices is not None and d.endpoint_id is not None:
            self.notices.note(d.tenant, d.endpoint_id)
        label = "retry" if finished.status == "pending" else finished.status
        if span is not None and span.is_recording():
            _describe_attempt(span, item, outcome, label)
        self.metrics.webhook_deliveries.labels(outcome=label).inc()
        self.metrics.webhook_delivery_seconds.observe(outcome.latency_s)
        # One line per attempt, through the JSON fast path (same fields, no LogRecord chain):
        # the chain cost ~6 % of a busy notifier's CPU (bench/RESULTS.md, issue 14).
        log_event(
            log, logging.INFO, "webhook attempt",
            {**context, "event_type": d.type, "status_code": outcome.status_code, "outcome": label,
             "latency_ms": round(outcome.latency_s * 1000, 1), "error": outcome.error,
             "retry_in_s": round(finished.next_attempt_at - now(), 3) if finished.next_attempt_at else None},
        )
        if finished.endpoint_disabled:
            log.warning("webhook endpoint disabled", extra={**context, "status_code": outcome.status_code})

    async def _record(self, attempted: Attempted, leased_until: float) -> Finished:
        """The attempt's outcome, recorded; again while the store is unreachable, as long as the
        delivery's lease lasts. Left unrecorded, a delivery stays leased until its lease runs
        out and is then sent again: a store that blinked (PostgreSQL restarting, a connection
        cut mid-statement) cost every attempt in flight a second send, 30 s late, and held the
        newer events of its job behind it. Recording again is safe: the delivery is settled
        only while this notifier holds the lease (``finish`` is fenced by it), and the attempt
        is logged once, by its id (``Attempted.id``, made once, before the first try): a record
        that committed and whose answer was lost is not written a second time."""
        delay = RECORD_RETRY_FIRST_S
        said = False
        while True:
            try:
                return await self.recorder.record(attempted)
            except StoreUnavailable as exc:
                # Renewals stretch the lease of every attempt in flight when they were sent.
                held_until = max(leased_until, self._renewed_at + LEASE_S)
                if self._stopping or time.monotonic() + delay >= held_until:
                    raise
                if not said:
                    said = True
                    log.warning("recording a webhook attempt failed: the store is unreachable; trying again",
                                extra={"delivery_id": attempted.claimed.delivery.id, "error": str(exc)})
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECORD_RETRY_MAX_S)

    async def _shutdown(self) -> None:
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(set(self._tasks), timeout=SHUTDOWN_GRACE_S)
        cancelled = [self._tasks[t].delivery.id for t in pending]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        # A batch already being written commits first: its leases are released by it, not below.
        with contextlib.suppress(Exception):
            await self.recorder.close()
        if cancelled:
            # The receiver may have had them: sending again is allowed (at-least-once,
            # receivers de-duplicate by webhook-id); waiting out the lease is not needed.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.queue.release(cancelled, self.owner))


def _describe_attempt(span: Span, item: Claimed, outcome: Outcome, label: str) -> None:
    d = item.delivery
    url = urlsplit(item.url)
    span.set_attributes({
        "http.request.method": "POST",
        "server.address": url.hostname or "",
        "server.port": url.port or (443 if url.scheme == "https" else 80),
        "herald.job.id": d.job_id,
        "herald.event.type": d.type,
        "herald.delivery.id": d.id,
        "herald.delivery.attempt": d.attempts + 1,
        "herald.endpoint.id": d.endpoint_id or "callback_url",
        "herald.delivery.outcome": label,
    })
    if outcome.status_code is not None:
        span.set_attribute("http.response.status_code", outcome.status_code)
    if not outcome.ok:
        error = str(outcome.status_code) if outcome.status_code is not None else (
            "timeout" if outcome.timed_out else (outcome.error or "error").split(":", 1)[0])
        span.set_attribute("error.type", error)
        span.set_status(StatusCode.ERROR, outcome.error or f"answered {outcome.status_code}")
