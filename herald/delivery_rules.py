"""The rules of a webhook delivery's life: one owner for every decision both stores make.

``herald.transitions`` is the rulebook of a job; this is the rulebook of its deliveries.
Pure functions over plain values: no I/O, no clock (the store passes its own ``at``), no
SQL. A store reads what a decision needs inside its transaction, asks here, and writes
what the answer says.

* **Placement** (``place``): where a job event goes when it is fanned out to a target
  that already has deliveries of the same job. Already there: nothing (a redelivered NATS
  message). A newer event of the job already sent or being sent: recorded ``superseded``
  at once, since sending it would go back in time. Otherwise it is pending, and the older
  ones that only wait (for a retry, or for a progress slot) are superseded by it: every
  payload carries the whole status. A ``job.progress`` waits for its slot, at most one
  per ``PROGRESS_INTERVAL_S`` per job and target.
* **Settlement** (``settle``): what an attempt leaves behind, from the retry policy's
  ``Plan``: delivered, failed, pending again after the plan's delay, or superseded when
  a newer delivery of the job and target exists (it carries the whole status). An
  endpoint's failing streak starts with its first failure and ends with a success; a
  ``410`` or ``ENDPOINT_DISABLE_AFTER_S`` of failing disables the endpoint, whose pending
  deliveries then fail (the one just attempted keeps its attempt count). A retry asked for
  while the attempt was in flight (``retry_asked``) is kept: unless the attempt delivered
  it (or its endpoint is disabled), the delivery is due again at once, whatever the plan.
* **Disabling** (``fails_with_its_endpoint``): an endpoint disabled (by its owner, a ``410``
  or five days of failing) fails its deliveries that wait; one that is being sent keeps its
  lease and is settled by its attempt, at a disabled endpoint (``settle``): a 2xx delivers
  it, anything else fails it at once. One whose lease ran out unrecorded (its notifier died)
  fails at the notifier's next prune.
  An attempt is recorded once: recording the same attempt again (``settled_before``) writes
  nothing and answers the delivery as it stands.
* **Fan-out share** (``share_fan_out``): how much of a batch of events one fan-out records
  now. One tenant's events add at most ``FAN_OUT_SHARE`` deliveries to one transaction (the
  first event always goes); the rest of that tenant's events, and every event of a tenant
  that already has some waiting, wait in the store, oldest first, and are fanned out in later
  transactions, ``FAN_OUT_SHARE`` per tenant each. Every tenant's events arrive in one
  stream in the order they were committed: without a share, a tenant with a hundred
  endpoints asked for more deliveries than a notifier records, and every other tenant's
  events waited behind that backlog in the stream (SPEC §13).
* **Keys** (``rotate``, ``signs``): a rotation makes a new current key; the previous one
  keeps signing for ``ROTATION_OVERLAP_S`` and is forgotten at the next rotation after
  that. The keys that sign are those not yet retired, newest first.

SQLite calls these functions, and so does PostgreSQL for key rotation. For fan-out and
finish PostgreSQL makes the same decisions in plpgsql, next to the data, so that each stays
one round trip (the measured fast path, ``bench/RESULTS.md``); it takes the numbers below as
arguments, and the store contract suite (``tests/store_contract/test_rulebook.py``) runs one
table of cases through both stores and requires the answers these functions give.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from herald.deliveries import Plan

PROGRESS = "job.progress"
PROGRESS_INTERVAL_S = 1.0  # at most one job.progress delivery per job and target per second
ENDPOINT_DISABLE_AFTER_S = 5 * 86400.0  # an endpoint failing continuously this long is disabled
ROTATION_OVERLAP_S = 24 * 3600.0  # a rotated-out key signs this long beside the new one
RESPONSE_KEEP_BYTES = 1024  # of each attempt's answer, kept in the attempt log
# A key's created_at is its primary key with its owner: a rotation within the same clock
# reading moves it forward by this much.
KEY_TIME_STEP_S = 1e-6
# Deliveries one tenant's events may add to one fan-out transaction: a tenant within the
# default limits (100 endpoints) gets five events' worth, another tenant's batch waits for
# at most that much of its writes (bench/RESULTS.md, "fan-out shared among tenants").
FAN_OUT_SHARE = 512
# Deliveries one fan-out transaction adds in all, whatever the number of tenants in its batch:
# PostgreSQL's takes an advisory lock per job and target it places, and its lock table holds
# about 64 per connection (max_locks_per_transaction) for every transaction at once.
FAN_OUT_BATCH = 4 * FAN_OUT_SHARE
# Tenants whose waiting events one drain transaction places, each up to its share: the others'
# turn comes next (they take turns by id), and a transaction writes at most this many shares.
DRAIN_TENANTS = 2


# ----- placement (fan-out) ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sibling:
    """A delivery of the same job to the same target, as the store holds it."""

    event_id: str
    version: int
    type: str
    status: str
    attempts: int
    scheduled_at: float
    lease_until: float | None


@dataclass(frozen=True, slots=True)
class Placement:
    """A new delivery's status and time, and the older siblings it supersedes (by version)."""

    status: Literal["pending", "superseded"]
    due: float  # its scheduled_at
    supersede: tuple[int, ...] = ()

    @property
    def next_attempt_at(self) -> float | None:
        return self.due if self.status == "pending" else None


def leased(lease_until: float | None, at: float) -> bool:
    return lease_until is not None and lease_until > at


def sent_or_sending(sibling: Sibling, at: float) -> bool:
    return sibling.attempts > 0 or leased(sibling.lease_until, at)


def stale(sibling: Sibling, version: int, at: float) -> bool:
    """An older delivery that only waits, which an event of ``version`` makes pointless:
    pending, not out right now, and either waiting for a retry or a progress slot."""
    return (sibling.version < version and sibling.status == "pending" and not leased(sibling.lease_until, at)
            and (sibling.attempts > 0 or sibling.type == PROGRESS))


def place(
    siblings: Iterable[Sibling], *, event_id: str, version: int, type: str, at: float,
    progress_interval: float = PROGRESS_INTERVAL_S,
) -> Placement | None:
    """Where an event of a job goes at one target, given that target's deliveries of the
    job (``siblings``); None: it is already there."""
    rows = list(siblings)
    if any(s.event_id == event_id for s in rows):
        return None
    # A newer event can reach a notifier first (several notifiers, redelivery): if a newer
    # delivery was sent or is being sent, this one would go back in time. Otherwise it goes
    # first, the newer one waiting behind it (the claim's order rule).
    if any(s.version > version and sent_or_sending(s, at) for s in rows):
        return Placement("superseded", at)
    superseded = tuple(sorted(s.version for s in rows if stale(s, version, at)))
    due = at
    if type == PROGRESS:
        # The last progress slot taken: sent, or still to be (not one superseded unsent).
        slots = [s.scheduled_at for s in rows
                 if s.type == PROGRESS and (s.attempts > 0 or (s.status != "superseded" and s.version not in superseded))]
        if slots:
            due = max(at, max(slots) + progress_interval)
    return Placement("pending", due, superseded)


# ----- the fan-out's share per tenant ------------------------------------------------------


def share_fan_out(costs: Sequence[tuple[str, int]], waiting: Collection[str] = (),
                  share: int = FAN_OUT_SHARE, batch: int = FAN_OUT_BATCH) -> list[bool]:
    """Which of a batch's events (``costs``: tenant and deliveries, in stream order) are fanned
    out now (True) and which wait in the store behind the tenant's earlier ones (False): each
    tenant's up to ``share`` deliveries (its first event always, if the batch has room), all of
    them up to ``batch`` (the first event always). ``waiting``: the tenants that already have
    events waiting; theirs all wait, so that a tenant's events are fanned out in the order
    they came."""
    spent: dict[str, int] = {}
    late = set(waiting)
    total = 0
    now: list[bool] = []
    for tenant, cost in costs:
        used = spent.get(tenant)
        if (tenant not in late and (used is None or used + cost <= share)
                and (total == 0 or total + cost <= batch)):
            spent[tenant] = (used or 0) + cost
            total += cost
            now.append(True)
        else:
            late.add(tenant)
            now.append(False)
    return now


# ----- settlement (after an attempt) -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndpointState:
    """The endpoint of an attempted delivery, as the attempt finds it."""

    status: str
    failing_since: float | None


@dataclass(frozen=True, slots=True)
class Settlement:
    status: Literal["delivered", "pending", "failed", "superseded"]
    next_attempt_at: float | None
    failing_since: float | None  # the endpoint's streak after this attempt (no endpoint: None)
    disable: bool = False  # disable the endpoint now; its other pending deliveries fail
    endpoint_disabled: bool = False  # the endpoint is disabled, now or already


def settle(
    plan: Plan, *, ok: bool, newer: bool, endpoint: EndpointState | None, at: float,
    disable_after: float = ENDPOINT_DISABLE_AFTER_S, retry_asked: bool = False,
) -> Settlement:
    """What an attempt with ``plan`` leaves behind. ``ok``: the answer was a 2xx; ``newer``:
    a newer delivery of the job exists for the target; ``endpoint``: None for a callback URL
    (or an endpoint deleted meanwhile); ``retry_asked``: a retry was asked for (``POST
    .../retry``) while this attempt was in flight, so a failure is sent again now, not after
    the plan's delay (nor given up, nor superseded: the user asked for this one)."""
    status: Literal["delivered", "pending", "failed", "superseded"]
    next_at: float | None = None
    if retry_asked and not ok:
        status, next_at = "pending", at
    elif plan.status != "retry":
        status = plan.status
    elif newer:
        status = "superseded"  # the newer one carries the whole status: no need to retry this one
    else:
        assert plan.delay_s is not None, "a retry plan has a delay"
        status, next_at = "pending", at + plan.delay_s
    if endpoint is None:
        return Settlement(status, next_at, None)
    if ok:
        return Settlement(status, next_at, None, endpoint_disabled=False)
    failing_since = endpoint.failing_since if endpoint.failing_since is not None else at
    disable = endpoint.status == "enabled" and (plan.disable_endpoint or at - failing_since >= disable_after)
    disabled = disable or endpoint.status != "enabled"
    if disabled and status == "pending":
        status, next_at = "failed", None
    return Settlement(status, next_at, failing_since, disable=disable, endpoint_disabled=disabled)


def fails_with_its_endpoint(status: str, lease_until: float | None, at: float) -> bool:
    """Whether a delivery of an endpoint disabled at ``at`` ends ``failed`` now: one that waits
    (pending, not out). One out right now is its attempt's to settle (``settle``, with the
    endpoint disabled: delivered by a 2xx, failed by anything else); failing it here took its
    lease, so its attempt was logged but its 2xx left it ``failed`` with no attempt counted."""
    return status == "pending" and not leased(lease_until, at)


def retry_kept(lease_until: float | None, at: float) -> bool:
    """Whether a retry asked for at ``at`` is kept for the attempt in flight (``settle``'s
    ``retry_asked``): the delivery is out now, and that attempt's record would otherwise set
    its next attempt by the plan, the request lost. One not out is simply due now."""
    return leased(lease_until, at)


def settled_before(
    status: Literal["delivered", "pending", "failed", "superseded"], next_attempt_at: float | None, *, ok: bool,
    endpoint: EndpointState | None,
) -> Settlement:
    """What recording an attempt the store already holds (the same ``Attempted.id``: its first
    record committed and the answer to it was lost) answers: nothing is written again, and the
    delivery is as it stands (``status``, ``next_attempt_at``), its endpoint disabled as the
    first record said when a failed attempt finds it so."""
    disabled = endpoint is not None and not ok and endpoint.status != "enabled"
    return Settlement(status, next_attempt_at if status == "pending" else None,
                      endpoint.failing_since if endpoint is not None else None, endpoint_disabled=disabled)


def settles_alone(plan: Plan, *, ok: bool) -> bool:
    """Whether ``settle`` answers the same whatever the store holds: a 2xx that the plan calls
    delivered is delivered, and ends its endpoint's failing streak (a store may record
    such attempts in bulk)."""
    return ok and plan.status == "delivered"


# ----- signing keys ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyTimes:
    """A key's times (in its owner's rows): when made, when it stops signing (None: current)."""

    created_at: float
    retire_at: float | None


T = TypeVar("T")


def signs(key: KeyTimes, at: float) -> bool:
    return key.retire_at is None or key.retire_at > at


def signing_keys(keys: Iterable[tuple[KeyTimes, T]], at: float) -> list[T]:
    """Of an owner's ``(times, key)`` pairs, the keys that sign at ``at``: the current one first,
    then any in their overlap."""
    live = [(times, key) for times, key in keys if signs(times, at)]
    return [key for _, key in sorted(live, key=lambda pair: pair[0].created_at, reverse=True)]


@dataclass(frozen=True, slots=True)
class Rotation:
    """What a rotation at ``at`` does to an owner's keys (each named by its ``created_at``)."""

    forget: tuple[float, ...]  # past their overlap: deleted
    retire: tuple[float, ...]  # the current key(s): sign until ``retire_at``
    retire_at: float
    created_at: float  # the new current key's


def rotate(
    keys: Sequence[KeyTimes], at: float, *, overlap: float = ROTATION_OVERLAP_S, step: float = KEY_TIME_STEP_S
) -> Rotation:
    forget = tuple(k.created_at for k in keys if k.retire_at is not None and k.retire_at <= at)
    kept = [k for k in keys if k.created_at not in forget]
    latest = max((k.created_at for k in kept), default=None)
    return Rotation(
        forget=forget,
        retire=tuple(k.created_at for k in kept if k.retire_at is None),
        retire_at=at + overlap,
        created_at=at if latest is None else max(at, latest + step),
    )
