"""What the webhook store hands out: endpoints, deliveries, attempts, claims.

Herald's own row types, shared by every storage backend and by the notifier and the
webhook routes. Nothing here knows about SQL.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import msgspec

from herald.jobs import ColumnAccess
from herald.webhook_signing import SigningKey
from schemas import JobEvent
from schemas.webhooks import TEST_EVENT_TYPE

CALLBACK_PREFIX = "callback:"
# herald_webhook_deliveries_total{outcome}: what became of an attempt ("retry": it is pending again;
# "paced": not attempted but rescheduled, its target being paced by the notifier's breaker).
DELIVERY_OUTCOMES = ("delivered", "retry", "failed", "superseded", "dropped", "paced")


# A webhook.test delivery belongs to no job: its job_id column holds this prefix and the
# test's own id, so the ordering and superseding rules (per target and job) never tie it
# to anything else.
TEST_JOB_PREFIX = "test:"
TEST_JOB_END = "test;"  # the first string after every "test:..." (';' follows ':'): a range's end
HEALTH_WINDOW = 100  # an endpoint's success rate is over its newest 100 deliveries

# Test events per endpoint (POST /webhooks/{id}/test): at most TEST_EVENTS_PER_WINDOW in any
# TEST_EVENT_WINDOW_S, counted in the store (so across every gateway). Enough to click "send
# test" while fixing a receiver; too few to use the endpoint's slots as a load generator
# against someone else's URL.
TEST_EVENTS_PER_WINDOW = 5
TEST_EVENT_WINDOW_S = 60.0


class EndpointLimitReached(Exception):
    """The tenant already has ``max_endpoints`` endpoints (SPEC §13)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"this tenant already has {limit} webhook endpoints (max_endpoints)")
        self.limit = limit


class TestEventsLimited(Exception):
    """Too many test events to one endpoint lately; the next one may go in ``retry_after_s``."""

    __test__ = False  # not a pytest class

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"at most {TEST_EVENTS_PER_WINDOW} test events per endpoint per {TEST_EVENT_WINDOW_S:g} s")
        self.retry_after_s = retry_after_s


def new_test_event() -> tuple[str, str]:
    """``(event_id, job_id column)`` of a new webhook.test delivery."""
    test_id = uuid.uuid4().hex
    return f"evt_test_{test_id}", TEST_JOB_PREFIX + test_id


# Notices (core NATS, not a stream: hints, never the truth): "this tenant's delivery log
# changed", published by notifiers after they commit deliveries or attempts, and by
# gateways after the API changed deliveries. Gateways wake the tenant's
# ``GET /webhooks/events`` streams with them; the portal then re-reads the API.
NOTICE_SUBJECTS = "herald-webhooks.>"


def notice_subject(tenant: str) -> str:
    return f"herald-webhooks.{tenant}"


class Notice(msgspec.Struct, kw_only=True):
    tenant: str
    endpoint_id: str | None  # None: any of the tenant's endpoints


def callback_owner(tenant: str) -> str:
    """The key owner for a tenant's ``callback_url`` deliveries (endpoints own keys by id)."""
    return f"callback:{tenant}"


def event_id(event: JobEvent) -> str:
    """The ``webhook-id``: one per event, the same for every endpoint and every retry."""
    return f"evt_{event.job_id}.{event.version}"


def _decode_list(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        return tuple(msgspec.json.decode(value))
    return tuple(value)


@dataclass(frozen=True, slots=True)
class EndpointRow:
    id: str
    tenant: str
    url: str
    event_types: tuple[str, ...]
    kinds: tuple[str, ...] | None
    signature: str
    status: str
    created_at: float
    updated_at: float
    failing_since: float | None

    @classmethod
    def from_mapping(cls, row: ColumnAccess) -> EndpointRow:
        values = {f.name: row[f.name] for f in fields(cls)}
        values["event_types"] = _decode_list(values["event_types"]) or ()
        values["kinds"] = _decode_list(values["kinds"])
        return cls(**values)

    def wants(self, event_type: str, kind: str) -> bool:
        return (
            self.status == "enabled"
            and event_type in self.event_types
            and (self.kinds is None or kind in self.kinds)
        )


def some_target_wants(event_type: str, kind: str, endpoints: Collection[EndpointRow], callback_url: str | None) -> bool:
    """Whether the event has a receiver: a matching enabled endpoint, or the job's callback URL,
    which gets every type but progress (SPEC §7). The committing transaction asks it to choose
    the event's subject (``herald.constants.event_subject``), the fan-out to choose its targets."""
    return bool(callback_url and event_type != "job.progress") or any(e.wants(event_type, kind) for e in endpoints)


@dataclass(frozen=True, slots=True)
class AttemptRow:
    n: int
    at: float
    status_code: int | None
    latency_ms: float | None
    error: str | None
    response: bytes | None


@dataclass(frozen=True, slots=True)
class DeliveryRow:
    seq: int
    id: str
    tenant: str
    target: str
    endpoint_id: str | None
    url: str | None
    event_id: str
    job_id: str
    version: int
    type: str
    status: str
    attempts: int
    scheduled_at: float
    next_attempt_at: float | None
    lease_owner: str | None
    lease_until: float | None
    created_at: float
    updated_at: float

    @classmethod
    def from_mapping(cls, row: ColumnAccess) -> DeliveryRow:
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class HealthRow:
    """An endpoint's newest deliveries, counted (``WebhookStore.endpoint_health``)."""

    delivered: int
    failed: int
    last: DeliveryRow | None


@dataclass(frozen=True, slots=True)
class Claimed:
    """A leased delivery with everything needed to send it."""

    delivery: DeliveryRow
    url: str
    body: bytes
    keys: tuple[SigningKey, ...]
    # The job's kept (traceparent, tracestate) (herald.tracing), read with the claim so that
    # sending needs no second round trip; None: the job has none (or is gone).
    trace_context: tuple[str, str | None] | None = None


# How many due deliveries ``DeliveryQueue.anything_due`` looks at, at most, for one whose
# target is not held: past that, it answers yes and the claim finds out.
DUE_PROBE_ROWS = 256


@dataclass(frozen=True, slots=True)
class LeaseOffer:
    """What a notifier may take of the deliveries a fan-out records (``DeliveryQueue.fan_out_leasing``):
    the arguments of ``DeliveryQueue.claim``, as they stand while the notifier claims nothing else."""

    owner: str
    lease_s: float
    per_target: int
    limit: int
    in_flight: Mapping[str, int]
    per_tenant: int = 0
    tenant_in_flight: Mapping[str, int] = field(default_factory=dict)
    held: Collection[str] = ()


@dataclass(frozen=True, slots=True)
class FannedOut:
    """A fan-out's outcome: how many deliveries it left pending, those of them it leased, and
    how many of its events wait for their tenant's share (``delivery_rules.share_fan_out``)."""

    pending: int
    claimed: list[Claimed] = field(default_factory=list)
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class Drained:
    """What one pass over the events waiting for their fan-out did (``DeliveryQueue.drain_waiting``):
    how many it fanned out, how many deliveries they left pending, and the last tenant it took
    (the next pass starts after it: the waiting tenants take turns)."""

    events: int
    pending: int
    last_tenant: str | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    status: str  # delivered, pending (retry), failed, superseded; dropped: deleted meanwhile
    next_attempt_at: float | None
    endpoint_disabled: bool


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt came to (the notifier's sender makes it). ``status_code`` is None
    when no answer arrived."""

    status_code: int | None
    latency_s: float
    error: str | None = None
    response: bytes = b""  # the answer's head, at most RESPONSE_KEEP_BYTES (herald.delivery_rules)
    retry_after_s: float | None = None
    timed_out: bool = False
    unreachable: bool = False  # no answer at all: a timeout, a refused or failed connection (notifier.breaker)

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


@dataclass(frozen=True, slots=True)
class Plan:
    """What the retry policy (``notifier.retry``) made of an outcome."""

    status: Literal["delivered", "retry", "failed"]
    delay_s: float | None = None
    disable_endpoint: bool = False


def new_attempt_id() -> str:
    """An attempt's own id (``Attempted.id``): unique among its delivery's attempts."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Attempted:
    """One finished attempt, to be recorded (``DeliveryQueue.finish_many``): what was sent, when, its answer
    and what the retry policy made of it.

    ``id`` is the attempt's own, chosen when it is made, before its first record: a store
    that already holds an attempt of that id for the delivery records nothing again and
    answers the delivery as it stands. So the notifier may record an attempt again when the
    answer to a record was lost (a connection cut after the commit) without the delivery's
    history showing one POST twice."""

    claimed: Claimed
    started_at: float
    outcome: Outcome
    plan: Plan
    id: str = field(default_factory=new_attempt_id)
