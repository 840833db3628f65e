"""The ``herald notifier`` process: committed job events in, signed webhook deliveries out.

Three loops share one store and one HTTP client:

* the fan-out reads the HERALD_EVENTS stream through the durable ``herald-notifier``
  consumer (every notifier process binds the same one, so they share the messages),
  records every delivery of a batch in one transaction (leasing those due at once to
  this notifier, ``Scheduler.fan_out``) and only then acks the messages, so a crash
  before the commit means NATS delivers them again, and a crash after it finds the rows
  already there (leased ones come back when their lease runs out);
* the scheduler sends whatever is due, whoever recorded it;
* the drain fans out the events a fan-out put to wait for their tenant's share
  (``herald.delivery_rules.share_fan_out``), whichever notifier put them there.

The scheduler starts before NATS is reachable: retries already in the store do not
wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from nats.aio.msg import Msg

from herald import jetstream
from herald.constants import EVENTS_STREAM, NOTIFIER_CONSUMER
from herald.metrics import metrics as process_metrics
from herald.pullstream import PullStream
from herald.settings import Settings
from herald.directory import running_directory
from herald.storage import open_storage
from herald.tasks import TaskOwner
from notifier.delivery import Sender
from notifier.notices import Notices
from notifier.retry import RetryPolicy
from notifier.scheduler import Scheduler
from schemas import JobEvent

log = logging.getLogger("herald.notifier")

FETCH_BATCH = 128
PULL_EXPIRES_S = 2.0
_event_decoder = msgspec.json.Decoder(JobEvent)


async def _fan_out(messages: list[Msg], scheduler: Scheduler, notices: Notices | None = None) -> None:
    events: list[JobEvent] = []
    decoded: list[Msg] = []
    for message in messages:
        try:
            events.append(_event_decoder.decode(message.data))
            decoded.append(message)
        except msgspec.DecodeError:
            log.error("undecodable job event dropped", extra={"subject": message.subject})
            await message.term()
    try:
        pending = await scheduler.fan_out(events)
    except Exception as exc:  # store busy or away: NATS gives the messages back shortly
        log.warning("recording webhook deliveries failed, will retry: %s", exc)
        for message in decoded:
            with contextlib.suppress(Exception):
                await message.nak(delay=1.0)
        return
    if pending:
        if notices is not None:
            for tenant in {e.tenant for e in events}:
                notices.note(tenant, None)  # which endpoints got them: the portal re-reads its own
    for message in decoded:  # only now: the deliveries are committed
        await message.ack()


async def _consume(events: PullStream, scheduler: Scheduler, stop: asyncio.Event,
                   notices: Notices | None = None) -> None:
    while not stop.is_set():
        try:
            messages = await events.next_batch(timeout=1.0)
            if not messages:
                continue
        except Exception as exc:  # NATS reconnecting: wait and fetch again
            log.warning("fetching job events failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            continue
        try:
            await _fan_out(messages, scheduler, notices)
        except Exception as exc:  # e.g. an ack lost to a reconnect: NATS redelivers, fan-out is idempotent
            log.warning("handling job events failed: %s", exc)


async def run_notifier(settings: Settings, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set; then stop fetching, finish or hand back attempts, drain NATS."""
    async with TaskOwner() as owner:
        storage = await open_storage(settings)
        owner.push_async_callback(storage.close)
        queue = storage.deliveries
        sender = await owner.enter_async_context(Sender(allow_private=settings.webhook_allow_private,
                                                        dns_servers=settings.webhook_dns_servers))
        notices = Notices()
        owner.spawn(notices.run(), "delivery-notices")
        scheduler = Scheduler(
            queue,
            sender,
            RetryPolicy(schedule=settings.webhook_retry_schedule, min_backoff_s=settings.webhook_min_backoff_s),
            process_metrics(),
            idle_poll_s=min(1.0, settings.sweep_interval_s),
            retention_s=settings.retention_s,
            notices=notices,
            pause_s=settings.webhook_pause_s,
        )
        # Delivering needs the store only: it runs while NATS is still away.
        owner.spawn(scheduler.run(), "webhook-scheduler", stop=scheduler.stop)  # hands its leases back
        owner.spawn(scheduler.drain_waiting(), "fan-out-waiting", stop=scheduler.stop)
        nc = await jetstream.connect_until_ready(settings, name="herald-notifier", stop=stop)
        if nc is None:
            return

        async def drain() -> None:
            with contextlib.suppress(Exception):
                await nc.drain()

        owner.push_async_callback(drain)
        notices.attach(nc)
        # Tenants' limits as they change at run time (SPEC §12, §13).
        directory = await owner.enter_async_context(running_directory(settings, storage, nc))
        js = nc.jetstream()
        try:
            await jetstream.until_stopped(jetstream.ensure_topology(js, settings), stop)
        except jetstream.Stopped:
            return
        events = PullStream(nc, EVENTS_STREAM, NOTIFIER_CONSUMER, batch=FETCH_BATCH, expires_s=PULL_EXPIRES_S)
        log.info("notifier ready", extra={"owner": scheduler.owner})
        owner.spawn(_consume(events, scheduler, stop, notices), "event-consumer")
        await stop.wait()
        log.info("notifier stopping")
        await events.close()
