"""NATS connection and the JetStream topology (streams, durable consumers, the result
bucket), created idempotently, on one server or a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from herald.constants import (
    EVENTS_STREAM,
    JOB_SUBJECTS,
    MAX_CHUNK_BYTES,
    JOBS_STREAM,
    KEPT_EVENT_SUBJECTS,
    NOTIFIER_CONSUMER,
    OUTPUT_LIVE_SUBJECTS,
    OUTPUT_STREAM,
    OUTPUT_SUBJECTS,
    RESULTS_BUCKET,
    WORKERS_CONSUMER,
    worker_consumer_name,
)
from herald.kinds import KindDeclaration, declared_kinds
from herald.natsclient import Client
from herald.settings import Settings
from herald.storage.results import ensure_result_buckets, retry_nats

log = logging.getLogger("herald.nats")


def auth_options(settings: Settings) -> dict[str, Any]:
    """How every process proves itself to NATS: ``HERALD_NATS_CREDS`` (a creds file), else the
    ``user:password@`` (or ``token@``) of the first URL of ``HERALD_NATS_URL`` that has one.
    Given as options, not only inside the URL, so that they go to every server the cluster
    announces too (a discovered server's URL carries none)."""
    if settings.nats_creds is not None:
        return {"user_credentials": str(settings.nats_creds)}
    for url in settings.nats_servers:
        parts = urlsplit(url)
        if parts.username:
            if parts.password is None:
                return {"token": unquote(parts.username)}
            return {"user": unquote(parts.username), "password": unquote(parts.password)}
    return {}


async def connect(
    settings: Settings, name: str, *, reconnected: Callable[[], Awaitable[None]] | None = None
) -> NATS:
    """Connect and keep reconnecting forever: NATS restarts must not kill a component.

    ``servers`` lists every URL of HERALD_NATS_URL (comma-separated for a cluster): the
    first connection goes to any one that answers, and a reconnect moves to any live
    server, the ones the cluster announces included; ``reconnected`` runs after each."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    nc = Client()  # nats-py's, with writes coalesced over a few turns of the loop (herald/natsclient.py)
    await nc.connect(
        servers=settings.nats_servers,
        **auth_options(settings),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,  # type: ignore[arg-type]  # a float works; nats-py's annotation says int
        connect_timeout=2,
        allow_reconnect=True,
        error_cb=on_error,
        reconnected_cb=reconnected,
        pending_size=64 * 1024 * 1024,
    )
    return nc


async def connect_until_ready(settings: Settings, name: str, *, stop: asyncio.Event) -> NATS | None:
    """``connect``, retrying until NATS answers (a process may start before it); None if
    ``stop`` is set first."""
    while not stop.is_set():
        try:
            return await connect(settings, name)
        except Exception as exc:
            log.warning("NATS not reachable yet, retrying: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
    return None


def stream_configs(settings: Settings) -> list[StreamConfig]:
    return [
        StreamConfig(
            name=JOBS_STREAM,
            subjects=[JOB_SUBJECTS],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            num_replicas=settings.nats_replicas,
        ),
        StreamConfig(
            name=EVENTS_STREAM,
            subjects=KEPT_EVENT_SUBJECTS,  # quiet events are live only (constants.is_live_only)
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            max_age=max(settings.retention_s, 3600.0),
            max_bytes=2 * 1024**3,
            num_replicas=settings.nats_replicas,
        ),
        # Streamed output (SPEC §8). Kept as long as the job: the sweeper purges a job's
        # subject when it deletes the job (no max_age: a job may run for days before its
        # retention starts). Each stored chunk is republished on herald-output-live.>, the
        # one subscription of every gateway's hub. Duplicate publishes (a retry after a lost
        # ack, Nats-Msg-Id <job>.<n>) are dropped.
        StreamConfig(
            name=OUTPUT_STREAM,
            subjects=[OUTPUT_SUBJECTS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            max_msg_size=MAX_CHUNK_BYTES + 4096,
            allow_direct=True,
            republish=RePublish(src=OUTPUT_SUBJECTS, dest=OUTPUT_LIVE_SUBJECTS),
            num_replicas=settings.nats_replicas,
        ),
    ]


# A tenant's consumer nobody pulled from for this long is removed by the server (a deployment
# with many short-lived tenants does not keep a consumer per tenant forever); a worker
# creates it again when the tenant next has work.
TENANT_CONSUMER_IDLE_S = 3600.0
UNCAPPED_ACK_PENDING = 10_000


def worker_consumer(
    settings: Settings, kind: KindDeclaration, token: str | None = None, max_running: int = 0
) -> ConsumerConfig:
    """The durable consumer of one kind's work messages of one tenant (``jobs.<kind>.<token>``),
    or (no token) of the messages an older Herald published on ``jobs.<kind>``.

    The lease: a worker extends it (in_progress) with every heartbeat; a message whose
    worker died comes back after ack_wait. max_deliver agrees with the kind's attempts
    (HERALD_MAX_ATTEMPTS unless the kind declares its own). A message is acknowledged only
    when its run ends, so a tenant's ``max_running`` as ``max_ack_pending`` lets JetStream
    itself hand out no more of the tenant's jobs of this kind than it may run, to all workers
    together (SPEC §13; the claim enforces the cap across kinds)."""
    return ConsumerConfig(
        durable_name=worker_consumer_name(kind.name, token),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=max(1.0, settings.heartbeat_timeout_s),
        max_deliver=kind.attempts(settings.max_attempts) + 1,
        max_ack_pending=max_running if max_running > 0 else UNCAPPED_ACK_PENDING,
        filter_subject=f"jobs.{kind.name}" if token is None else f"jobs.{kind.name}.{token}",
        deliver_policy=DeliverPolicy.ALL,
        num_replicas=settings.nats_replicas,
        inactive_threshold=None if token is None else TENANT_CONSUMER_IDLE_S,
    )


async def ensure_consumer(js: JetStreamContext, config: ConsumerConfig) -> None:
    """Create the durable consumer, or update it where its settings differ (idempotent)."""
    try:
        info = await js.consumer_info(JOBS_STREAM, config.durable_name or "")
    except NotFoundError:
        await js.add_consumer(JOBS_STREAM, config)
        return
    if _consumer_settings(info.config) != _consumer_settings(config):
        await js.add_consumer(JOBS_STREAM, config)  # same durable name: updates it


def notifier_consumer(settings: Settings) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=NOTIFIER_CONSUMER,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30.0,
        max_deliver=-1,
        max_ack_pending=10_000,
        filter_subjects=KEPT_EVENT_SUBJECTS,  # the whole stream, named: an older stream kept every event
        deliver_policy=DeliverPolicy.NEW,
        num_replicas=settings.nats_replicas,
    )


# A cluster that has just started has no meta leader for a few seconds: JetStream answers
# "unavailable" or not at all until it elects one.
TOPOLOGY_RETRY_FOR_S = 60.0


async def ensure_topology(
    js: JetStreamContext, settings: Settings, kinds: Iterable[KindDeclaration] | None = None
) -> None:
    """Create or update streams, the notifier's durable consumer and (HERALD_RESULT_STORE=nats)
    the result bucket, each with HERALD_NATS_REPLICAS copies. Safe to run from many
    processes, and retried whole (every step is idempotent) while the cluster is electing its
    leaders. Workers create their consumers (one per kind and tenant) when first needed
    (workers/dispatch.py); ``kinds`` is kept for callers that name them."""
    declared = list(declared_kinds().values() if kinds is None else kinds)
    await retry_nats(lambda: _ensure_topology(js, settings, declared), for_s=TOPOLOGY_RETRY_FOR_S)


async def _ensure_topology(js: JetStreamContext, settings: Settings, kinds: list[KindDeclaration]) -> None:
    for config in stream_configs(settings):
        assert config.name is not None
        try:
            await js.stream_info(config.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
                continue
            except BadRequestError:  # another process created it first (timeouts: retried whole)
                pass
        await js.update_stream(config)
    await _drop_shared_worker_consumer(js)
    consumers = [(EVENTS_STREAM, notifier_consumer(settings))]
    for stream, consumer in consumers:
        try:
            info = await js.consumer_info(stream, consumer.durable_name or "")
        except NotFoundError:
            await js.add_consumer(stream, consumer)
            continue
        if _consumer_settings(info.config) != _consumer_settings(consumer):
            await js.add_consumer(stream, consumer)  # same durable name: updates it
    if settings.effective_result_store == "nats":
        await ensure_result_buckets(js, RESULTS_BUCKET, settings.nats_replicas)


async def _drop_shared_worker_consumer(js: JetStreamContext) -> None:
    """Remove the one consumer of every kind (``herald-workers`` on ``jobs.>``) that Herald
    used before consumers per kind: on a work-queue stream it would overlap with theirs.
    Its unacknowledged messages stay in the stream and go to the kinds' consumers."""
    try:
        await js.delete_consumer(JOBS_STREAM, WORKERS_CONSUMER)
    except NotFoundError:
        return
    log.warning("removed the shared worker consumer of an older Herald; each kind now has its own",
                extra={"consumer": WORKERS_CONSUMER})


def _consumer_settings(config: ConsumerConfig) -> tuple[object, ...]:
    """What ensure_topology may change on an existing durable consumer."""
    filters = tuple(config.filter_subjects or ([config.filter_subject] if config.filter_subject else []))
    return (config.ack_wait, config.max_deliver, config.num_replicas or 0, config.max_ack_pending, filters)
