"""NATS connection and the JetStream topology (streams and durable consumers), created idempotently."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from herald.constants import (
    EVENT_SUBJECTS,
    EVENTS_STREAM,
    JOB_SUBJECTS,
    JOBS_STREAM,
    NOTIFIER_CONSUMER,
    WORKERS_CONSUMER,
)
from herald.settings import Settings

log = logging.getLogger("herald.nats")


async def connect(
    settings: Settings, name: str, *, reconnected: Callable[[], Awaitable[None]] | None = None
) -> NATS:
    """Connect and keep reconnecting forever: NATS restarts must not kill a component."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    return await nats.connect(
        settings.effective_nats_url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        connect_timeout=2,
        allow_reconnect=True,
        error_cb=on_error,
        reconnected_cb=reconnected,
        pending_size=64 * 1024 * 1024,
    )


def stream_configs(settings: Settings) -> list[StreamConfig]:
    return [
        StreamConfig(
            name=JOBS_STREAM,
            subjects=[JOB_SUBJECTS],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=120.0,
        ),
        StreamConfig(
            name=EVENTS_STREAM,
            subjects=[EVENT_SUBJECTS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            max_age=max(settings.retention_s, 3600.0),
            max_bytes=2 * 1024**3,
        ),
    ]


def worker_consumer(settings: Settings) -> ConsumerConfig:
    # The lease: a worker extends it (in_progress) with every heartbeat; a message whose
    # worker died comes back after ack_wait. max_deliver agrees with HERALD_MAX_ATTEMPTS.
    return ConsumerConfig(
        durable_name=WORKERS_CONSUMER,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=max(1.0, settings.heartbeat_timeout_s),
        max_deliver=settings.max_attempts + 1,
        max_ack_pending=10_000,
        filter_subject=JOB_SUBJECTS,
        deliver_policy=DeliverPolicy.ALL,
    )


def notifier_consumer(settings: Settings) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=NOTIFIER_CONSUMER,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30.0,
        max_deliver=-1,
        max_ack_pending=10_000,
        filter_subject=EVENT_SUBJECTS,
        deliver_policy=DeliverPolicy.NEW,
    )


async def ensure_topology(js: JetStreamContext, settings: Settings) -> None:
    """Create or update streams and durable consumers. Safe to run from many processes."""
    for config in stream_configs(settings):
        try:
            await js.stream_info(config.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
                continue
            except Exception:  # another process created it first
                pass
        await js.update_stream(config)
    for stream, consumer in ((JOBS_STREAM, worker_consumer(settings)), (EVENTS_STREAM, notifier_consumer(settings))):
        try:
            info = await js.consumer_info(stream, consumer.durable_name or "")
        except NotFoundError:
            await js.add_consumer(stream, consumer)
            continue
        if (info.config.ack_wait, info.config.max_deliver) != (consumer.ack_wait, consumer.max_deliver):
            await js.add_consumer(stream, consumer)  # same durable name: updates it
