"""NATS connection and the JetStream topology (streams, durable consumers, the result
bucket), created idempotently, on one server or a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar
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
from nats.errors import AuthorizationError
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

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
from herald.settings import Settings, redact_url
from herald.storage.results import ensure_result_buckets, retry_nats

log = logging.getLogger("herald.nats")

T = TypeVar("T")


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


# The first connect gives up after this many retries of each server (nats-py's
# max_reconnect_attempts while connecting: 0 or -1 would retry a refused port for ever, and a
# cancellation of that loop can be lost inside it). Once connected, reconnects never stop.
FIRST_CONNECT_RETRIES = 1
RETRY_FIRST_S = 0.5  # connect_until_ready's wait after a failed first connect, doubling ...
RETRY_MAX_S = 2.0  # ... up to this
CANCEL_AGAIN_S = 0.25  # until_stopped: how often a cancellation that was not taken is repeated ...
GIVE_UP_CANCEL_S = 5.0  # ... and for how long, at most


def _where(settings: Settings) -> str:
    """The NATS a process was told to use, and by which setting, without its password."""
    return (f"{redact_url(settings.nats_url)} (HERALD_NATS_URL)" if settings.nats_url
            else f"{settings.effective_nats_url} (HERALD_NATS_PORT; HERALD_NATS_URL is unset)")


class NatsConnectError(Exception):
    """No server of HERALD_NATS_URL accepted the first connection: unreachable, or it refused
    the credentials (``authorization``). The message names the setting and the URL (without
    its password)."""

    def __init__(self, settings: Settings, failures: list[BaseException]) -> None:
        self.authorization = any(_refused_authorization(f) for f in failures)
        if self.authorization:
            how = "HERALD_NATS_CREDS" if settings.nats_creds is not None else "the user and password in HERALD_NATS_URL"
            self.reason = f"refused authorization: check {how}"
        else:
            self.reason = f"is not reachable: {failures[-1] if failures else 'no server answered'}"
        super().__init__(f"NATS at {_where(settings)} {self.reason}")


# JetStream API error codes (nats-server's errors.json) that say it is off, not busy.
JS_NOT_ENABLED = 10076  # "JetStream not enabled"
JS_NOT_ENABLED_FOR_ACCOUNT = 10039  # "JetStream not enabled for account"


class JetStreamNotEnabled(Exception):
    """The NATS server answers, but has no JetStream (``for_account``: not for the account
    Herald's user is in). A setting of that server, which no waiting changes: a process stops
    at once saying so, where one that waited for a topology it cannot create stopped after
    a minute of retries with a ``ServiceUnavailableError``."""

    def __init__(self, settings: Settings, *, for_account: bool) -> None:
        self.for_account = for_account
        if for_account:
            fix = "enable it for the account of Herald's NATS user (jetstream: enabled in its accounts block)"
        else:
            fix = "start nats-server with -js, or a jetstream {} block in its config"
        scope = " for Herald's account" if for_account else ""
        super().__init__(f"JetStream is not enabled{scope} on the NATS server at {_where(settings)}: {fix}")


async def require_jetstream(js: JetStreamContext, settings: Settings) -> None:
    """``JetStreamNotEnabled`` when the server says JetStream is off; any other failure (a
    timeout, a cluster still electing its meta leader) is raised as it is, for the caller's
    retries. A server that accepts clients has its JetStream API up already (one started
    with it, alone or in a cluster, answers from its first connection on)."""
    try:
        await js.account_info()
    except ServiceUnavailableError as exc:
        # Without a code it is nats-py's "no responders": nothing serves JetStream's API on
        # this server, which is what nats.go calls ErrJetStreamNotEnabled. With one, it is
        # the server's answer, and only these codes say JetStream is off.
        if exc.code is None or exc.err_code in (JS_NOT_ENABLED, JS_NOT_ENABLED_FOR_ACCOUNT):
            raise JetStreamNotEnabled(settings, for_account=exc.err_code == JS_NOT_ENABLED_FOR_ACCOUNT) from None
        raise


def _refused_authorization(exc: BaseException) -> bool:
    # nats-py raises a server's -ERR during the first connect as a plain nats.errors.Error.
    text = str(exc).lower()
    return isinstance(exc, AuthorizationError) or "authorization" in text


class Stopped(Exception):
    """``until_stopped``: the stop event was set before the work ended."""


async def until_stopped(work: Awaitable[T], stop: asyncio.Event) -> T:
    """``work``'s result, unless ``stop`` is set first: then ``work`` is cancelled, and
    ``Stopped`` raised once it has ended. So does a cancellation of the caller (re-raised).

    The cancellation is repeated until ``work`` ends (at most GIVE_UP_CANCEL_S): nats-py's
    connect can swallow one (Python 3.11's ``asyncio.wait_for`` returns its result when it
    completes at the moment it is cancelled, and nats-py then tries the next server)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    done: set[asyncio.Future[Any]] = set()
    try:
        done, _ = await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():  # stop was set, or the caller is being cancelled
            await _cancel_until_ended(task)
    if task not in done:
        raise Stopped
    return task.result()


async def _cancel_until_ended(task: asyncio.Future[Any]) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + GIVE_UP_CANCEL_S
    while not task.done() and loop.time() < give_up:
        task.cancel()
        await asyncio.wait((task,), timeout=CANCEL_AGAIN_S)
    if not task.done():
        log.error("a NATS call did not end when cancelled; leaving it behind")
    # Its outcome no longer matters; retrieved so that asyncio does not log it as unseen.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def connect(
    settings: Settings, name: str, *, reconnected: Callable[[], Awaitable[None]] | None = None
) -> NATS:
    """Connect, then keep reconnecting forever: NATS restarts must not kill a component.

    ``servers`` lists every URL of HERALD_NATS_URL (comma-separated for a cluster): the
    first connection goes to any one that answers, and a reconnect moves to any live
    server, the ones the cluster announces included; ``reconnected`` runs after each.

    The first connection is tried a bounded number of times (each server twice): if none
    accepts it, ``NatsConnectError`` says why (unreachable, or authorization refused) and
    the half-made client is closed, as it is when the call is cancelled."""
    failures: list[BaseException] = []
    connected = False

    async def on_error(exc: Exception) -> None:
        if connected:
            log.warning("nats error: %s", exc)
        else:
            failures.append(exc)  # said once, by NatsConnectError, if no server accepts

    nc = Client()  # nats-py's, with writes coalesced over a few turns of the loop (herald/natsclient.py)
    try:
        await nc.connect(
            servers=settings.nats_servers,
            **auth_options(settings),
            name=name,
            max_reconnect_attempts=FIRST_CONNECT_RETRIES,
            reconnect_time_wait=0.25,  # type: ignore[arg-type]  # a float works; nats-py's annotation says int
            connect_timeout=2,
            allow_reconnect=True,
            error_cb=on_error,
            reconnected_cb=reconnected,
            pending_size=64 * 1024 * 1024,
        )
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), timeout=2)
        if isinstance(exc, Exception):
            raise NatsConnectError(settings, failures or [exc]) from exc
        raise
    # nats-py reads the option at each reconnect: from now on it never gives up.
    nc.options["max_reconnect_attempts"] = -1
    connected = True
    return nc


async def connect_until_ready(
    settings: Settings, name: str, *, stop: asyncio.Event,
    reconnected: Callable[[], Awaitable[None]] | None = None,
) -> NATS | None:
    """``connect``, retrying until NATS answers (a process may start before it); None as
    soon as ``stop`` is set, whatever the attempt under way was doing."""
    delay = RETRY_FIRST_S
    while not stop.is_set():
        try:
            return await until_stopped(connect(settings, name, reconnected=reconnected), stop)
        except Stopped:
            return None
        except Exception as exc:
            log.warning("%s; retrying in %g s", exc, delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=delay)
        delay = min(2 * delay, RETRY_MAX_S)
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
    (workers/dispatch.py); ``kinds`` is kept for callers that name them.

    A server without JetStream is no such passing state: ``JetStreamNotEnabled`` at once."""
    declared = list(declared_kinds().values() if kinds is None else kinds)
    await retry_nats(lambda: _ensure_topology(js, settings, declared), for_s=TOPOLOGY_RETRY_FOR_S)


async def _ensure_topology(js: JetStreamContext, settings: Settings, kinds: list[KindDeclaration]) -> None:
    await require_jetstream(js, settings)  # not one of retry_nats's transient errors: raised at once
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
