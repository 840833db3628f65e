"""The storage contract: every fact Herald shares between processes goes through these ports.

Two backends implement them: SQLite (``herald.storage.sqlite``, the embedded default, one
machine) and PostgreSQL (``herald.storage.postgres``, any number of machines). Results
have their own port with two backends too: local files and the NATS object store
(``herald.storage.results``). Callers see only these Protocols and Herald's own row types
(``herald.jobs``, ``herald.deliveries``): no SQL, no driver rows, no connection handles.

Every method is async. Timestamps are Unix seconds (floats) taken from **the store's
clock** (SQLite: this machine's; PostgreSQL: the database server's), never the caller's:
leases, heartbeats, deadlines, retention and retry times are judged by one clock however
many machines run Herald. ``clock()`` exposes it to callers that compare against stored
times (the sweeper).

Concurrency rules (each backend must keep them without relying on a database-wide lock):

* **Compare-and-set transitions.** ``transition`` reads the job, checks the ``Change``
  against it (``herald.transitions.refusal``) and writes only if the row is still at the
  version it read. If another writer got there first it re-reads and checks again, or
  refuses (``TransitionRejected``). A stale writer can never overwrite a newer version.
* **Exclusive claims.** ``DeliveryQueue.claim`` leases only deliveries nobody else holds
  (PostgreSQL: ``FOR UPDATE SKIP LOCKED``); two notifiers never send one delivery at once.
* **Idempotency converges.** Two ``accept`` calls with one tenant's Idempotency-Key at the
  same moment end with one job: the loser sees the winner's job (``replayed=True``) or a
  mismatch, never a unique-violation error.
* **One rate budget.** ``accept`` spends the tenant's start token in the same transaction
  as the job, so every gateway draws on one bucket, and a start that fails spends nothing.
* **A capped claim counts under a lock.** A claim with ``Change.max_running`` counts the
  tenant's running jobs and writes in one transaction that no other capped claim of the
  tenant can interleave with (SQLite: the write lock; PostgreSQL: the tenant's counter
  row), so two workers never both take a tenant's last running slot. Claims without a cap
  take no extra lock.
* **Ordered history.** One job's events have consecutive versions. Events of one tenant
  get increasing ``seq`` numbers, the tenant feed's one order: a number, once readable, is
  never given to another event, and no event is given a number at or below one already
  readable (so a reader polling ``tenant_events`` after its last seq misses nothing and
  reads nothing twice); a job's events are numbered in version order; an event whose
  transaction began after another's committed is numbered after it. Numbers are gap-free
  but for events retention deleted. A backend numbers an event in its transaction (SQLite:
  its one writer serialises every write anyway) or after commit (PostgreSQL: in the relay's
  ``outbox_batch``, so that no tenant-wide lock is held through a commit); until then
  ``Accepted.event``/``Transition.event`` and ``job_events`` carry ``seq`` 0, and
  ``tenant_events``/``last_event_seq`` do not count the event. ``outbox_batch`` returns
  every event row numbered, its payload the ``JobEvent`` with its ``seq``.
* **One webhook rulebook.** Where a fanned-out event goes (superseded, pending, its
  progress slot), what an attempt leaves behind (delivered, retried, superseded, failed,
  the endpoint disabled) and what a key rotation does are decided by
  ``herald.delivery_rules``, never by a backend on its own: SQLite calls it, PostgreSQL's
  plpgsql makes the same decisions for fan-out and finish with its numbers passed in, and
  ``tests/store_contract/test_rulebook.py`` holds both stores to it, case by case. Fan-out and ``finish`` decide and write in one transaction, in turn with
  any other fan-out or finish of the same job and target; a rotation, in turn with any other
  change of the owner's keys. Both schemas keep the keys the rules rely on: one delivery per
  event and target (``UNIQUE (event_id, target)``), one current signing key per owner
  (``webhook_keys_current``).

What the backends may do differently, and callers must allow for:

* ``DeliveryQueue.claim`` may return fewer than ``limit`` while more are due: PostgreSQL
  passes over rows another notifier's claim holds locked at that moment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from herald.deliveries import (
    Attempted,
    AttemptRow,
    Claimed,
    DeliveryRow,
    EndpointRow,
    Drained,
    FannedOut,
    Finished,
    HealthRow,
    LeaseOffer,
    Outcome,
    Plan,
)
from herald.jobs import Accepted, IdempotencyClaim, JobRow, NewJob, Transition
from herald.sealing import Sealer
from herald.tenants import AuditRow, DirectorySnapshot, KeyRow, TenantRow
from herald.transitions import Change
from herald.webhook_signing import SigningKey
from schemas import JobEvent

CommitListener = Callable[[JobRow, JobEvent], None]


@dataclass(frozen=True, slots=True)
class StartBudget:
    """A tenant's token bucket for job starts: ``rate`` per second, up to ``burst`` at once."""

    rate: float
    burst: float


@dataclass(frozen=True, slots=True)
class OutboxRow:
    seq: int
    subject: str
    msg_id: str
    payload: bytes
    traceparent: str | None = None  # the job's trace context, sent as the message's headers
    tracestate: str | None = None


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Gauges for /metrics and back-pressure, read in one go."""

    oldest_queued_age_s: float
    outbox_pending: int
    outbox_oldest_age_s: float
    fan_out_waiting: int = 0  # job events waiting for their tenant's share of the webhook fan-out
    fan_out_waiting_age_s: float = 0.0  # how long the oldest of them has waited


class JobStore(Protocol):
    """Jobs, their history (events), the outbox, idempotency keys, tombstones, shared secrets."""

    # True: a success may carry its small JSON result in ``Change.result_body``, kept in the
    # job's row by the same transaction (SQLite). False: every result goes through the
    # ``ResultStore`` and the row names it (PostgreSQL: its results live in NATS, §11).
    keeps_results: bool

    async def open(self) -> None:
        """Connect and create or migrate the schema, seal plaintext secrets an older Herald left
        (safe when many processes start at once)."""

    async def close(self) -> None: ...

    async def ping(self) -> None:
        """Raise if the store cannot be reached now (``/readyz``)."""

    def on_commit(self, callback: CommitListener) -> None:
        """Called on the loop after each event this process committed (relay wake-up, metrics, logs)."""

    async def clock(self) -> float:
        """The store's clock, in Unix seconds."""

    # ----- writes ----------------------------------------------------------------------

    async def accept(
        self, new: NewJob, idempotency: IdempotencyClaim | None = None, budget: StartBudget | None = None
    ) -> Accepted:
        """In one transaction: spend a start token (``RateLimited``), resolve the key (replay or
        ``IdempotencyMismatch``), write the job queued at version 1, its key, its first event
        and its outbox rows (the event and the work message)."""

    async def find_replay(self, tenant: str, claim: IdempotencyClaim) -> JobRow | None:
        """What ``accept`` with ``claim`` would replay, read without writing or spending: the
        job the tenant's live key names when the fingerprints agree; ``IdempotencyMismatch``
        when they do not; None when the key is not live (never used, expired, its job gone),
        so that ``accept`` would start a new job. For an accept refused before the store
        (back-pressure), which must still answer a replay: a replay starts nothing."""

    async def transition(self, job_id: str, change: Change) -> Transition:
        """The only writer of job state: compare-and-set, history row, outbox rows; or
        ``TransitionRejected`` with nothing changed."""

    async def heartbeat(self, job_id: str, attempt: int) -> JobRow | None:
        """Move ``heartbeat_at``/``updated_at`` of a running job of this attempt (not an event).
        None: the job is no longer this worker's."""

    def remember(self, row: JobRow) -> None:
        """``row`` is the job as committed at its version, learnt without a read (a work
        message carries its job as queued, ``herald.workmessage``). A store that judges a
        transition on the row it saw last (PostgreSQL) may judge the job's next one on it,
        which its compare-and-set checks; another ignores it."""

    # ----- reads -----------------------------------------------------------------------

    async def get(self, job_id: str) -> JobRow | None: ...

    async def get_for_tenant(self, tenant: str, job_id: str) -> JobRow | None: ...

    async def tombstone_tenant(self, job_id: str) -> str | None:
        """The tenant of a job deleted by retention (``410``), else None."""

    async def list_jobs(
        self, tenant: str, *, state: str | None, kind: str | None, before: tuple[float, str] | None, limit: int
    ) -> list[JobRow]:
        """Newest first (created_at, id), strictly before ``before``."""

    async def job_events(self, job_id: str, after_version: int, limit: int = 1000) -> list[JobEvent]: ...

    async def tenant_events(self, tenant: str, after_seq: int, limit: int, kind: str | None = None) -> list[JobEvent]:
        """The tenant's numbered events after ``after_seq``, in seq order: every event whose
        transaction committed before the call among them (a backend that numbers after commit
        numbers the tenant's committed events first)."""

    async def last_event_seq(self, tenant: str) -> int:
        """The tenant's highest seq given so far (0: none)."""

    async def stats(self) -> StoreStats: ...

    async def queued_ages(self, kinds: Sequence[str]) -> dict[str, float]:
        """The age of the oldest queued job of each of ``kinds`` (0.0 when none is queued), on
        the store's clock: per-kind queue age in /metrics, per-kind back-pressure. One index
        lookup per kind (a partial index on queued jobs by kind and age)."""

    async def tenant_queued_age(self, kind: str, tenant: str) -> float:
        """The age of the tenant's oldest queued job of ``kind`` (0.0 when none), on the store's
        clock: per-tenant back-pressure (SPEC §13). One index lookup."""

    async def running_counts(self, tenants: Sequence[str]) -> dict[str, int]:
        """How many jobs each tenant runs now, deployment-wide (``max_running``, SPEC §13)."""

    # ----- outbox ----------------------------------------------------------------------

    async def outbox_batch(self, limit: int, *, stale_after_s: float | None = None) -> list[OutboxRow]:
        """The oldest unpublished rows, in commit order: those this process committed, or
        with ``stale_after_s``, any process's rows committed longer ago than that (on the
        store's clock): what a process that died left behind. Their events numbered first
        if the backend numbers after commit ("Ordered history")."""

    async def outbox_done(self, seqs: Sequence[int]) -> None:
        """Delete rows whose PubAck arrived."""

    # ----- sweeping and retention ------------------------------------------------------

    async def live_jobs(self, *, stale_before: float, deadline_before: float) -> list[JobRow]:
        """Running jobs whose heartbeat is older than ``stale_before``, and live jobs past
        their deadline (times on the store's clock)."""

    async def expired(self, at: float, limit: int = 500) -> list[JobRow]:
        """Jobs whose retention ended by ``at``; the caller deletes their results, then ``forget``s them."""

    async def forget(self, jobs: Sequence[JobRow], at: float) -> None:
        """Delete jobs with their history and keys, leave tombstones, drop expired keys."""

    # ----- shared secrets --------------------------------------------------------------

    async def signing_key(self) -> bytes:
        """The deployment's key for signed URLs: generated by the first process to ask, then
        the same for every process of the deployment."""

    async def reseal_secrets(self) -> int:
        """Seal every secret the store keeps (signing keys, callback secrets, the URL-signing
        key) under the first key of ``HERALD_SECRET_KEY``; how many rows changed. ``open()``
        already seals plaintext rows; this also moves rows off an older key (rotation)."""


class WebhookStore(Protocol):
    """Endpoints, their signing keys, the tenants' callback secrets and the delivery log."""

    async def create_endpoint(
        self, tenant: str, *, url: str, event_types: Sequence[str], kinds: Sequence[str] | None, signature: str,
        max_endpoints: int | None = None,
    ) -> tuple[EndpointRow, SigningKey]:
        """A new enabled endpoint with its first key. With ``max_endpoints`` (None: no cap), raises
        ``EndpointLimitReached`` if the tenant already has that many, 0 refusing every one
        (counted and inserted as one step, so concurrent creations at several gateways cannot
        pass the cap together)."""

    async def get_endpoint(self, tenant: str, endpoint_id: str) -> EndpointRow | None: ...

    async def list_endpoints(self, tenant: str, *, before: tuple[float, str] | None, limit: int) -> list[EndpointRow]: ...

    async def update_endpoint(self, tenant: str, endpoint_id: str, changes: Mapping[str, Any]) -> EndpointRow | None:
        """Apply url/event_types/kinds/status; disabling fails the endpoint's pending deliveries
        that are not in flight (``delivery_rules.fails_with_its_endpoint``): one in flight is
        settled by its attempt."""

    async def delete_endpoint(self, tenant: str, endpoint_id: str) -> bool:
        """The endpoint with its keys, deliveries and attempts."""

    async def rotate_endpoint_key(self, tenant: str, endpoint_id: str) -> SigningKey | None:
        """A new current key; the old one keeps signing for the overlap (24 h)."""

    async def callback_key(self, tenant: str) -> SigningKey:
        """The tenant's current callback secret, created on first use."""

    async def rotate_callback_key(self, tenant: str) -> SigningKey: ...

    async def list_deliveries(
        self, endpoint_id: str, *, status: str | None, before_seq: int | None, limit: int
    ) -> list[DeliveryRow]:
        """Newest first. The caller has already checked that the endpoint is the tenant's."""

    async def attempts(self, delivery_ids: Sequence[str]) -> dict[str, list[AttemptRow]]: ...

    async def get_delivery(self, endpoint_id: str, delivery_id: str) -> DeliveryRow | None: ...

    async def retry_now(self, endpoint_id: str, delivery_id: str) -> DeliveryRow | None:
        """Make a delivery due now, whatever its status (same id, same webhook-id). One in flight
        keeps the request for its attempt's record (``delivery_rules.retry_kept``): a failure is
        then due again at once, whatever the plan. None: the endpoint has no such delivery."""

    async def recover(self, tenant: str, endpoint_id: str, since: float) -> int:
        """Make every ``failed`` delivery of the endpoint created at or after ``since`` due now,
        as ``retry_now`` does, in one transaction; how many. Nothing while the endpoint is not
        enabled (checked in the same transaction, so a concurrent disable wins cleanly)."""

    async def add_test_delivery(self, tenant: str, endpoint_id: str, event_id: str, job_key: str,
                                body: bytes) -> DeliveryRow | None:
        """Queue one ``webhook.test`` delivery to an enabled endpoint, due now, with its signed
        body (``herald.deliveries.new_test_event`` names it). None: no such enabled endpoint.
        Raises ``TestEventsLimited`` past ``TEST_EVENTS_PER_WINDOW`` per endpoint in
        ``TEST_EVENT_WINDOW_S`` (counted from the store, so across every gateway)."""

    async def messages(self, event_ids: Sequence[str]) -> dict[str, bytes]:
        """The bodies of these events as signed and sent (absent: pruned)."""

    async def endpoint_health(self, endpoint_ids: Sequence[str], window: int) -> dict[str, HealthRow]:
        """Per endpoint: delivered and failed among its newest ``window`` deliveries, and the newest one."""


class TenantStore(Protocol):
    """Tenants, their API keys (hashes only) and the admin audit log (SPEC §12).

    Every change bumps the directory's ``version`` and appends its audit row in the same
    transaction, so a process that sees a new version and re-reads the snapshot sees the
    change, and no change goes unaudited.
    """

    async def directory_version(self) -> int:
        """A number that grows with every change (cheap: one row)."""
        ...

    async def snapshot(self) -> DirectorySnapshot:
        """Every tenant row and every unrevoked key, with the version they are at."""
        ...

    async def create_tenant(self, tenant_id: str, limits: Mapping[str, float], *, source: str = "api",
                            disabled: bool = False) -> TenantRow | None:
        """None if the id is taken."""
        ...

    async def get_tenant(self, tenant_id: str) -> TenantRow | None: ...

    async def list_tenants(self, *, after: str | None, limit: int) -> list[TenantRow]:
        """By id, those after ``after``."""
        ...

    async def update_tenant(self, tenant_id: str, *, limits: Mapping[str, float | None] | None,
                            disabled: bool | None, source_if_new: str | None = None) -> TenantRow | None:
        """Set (a value) or clear (None: back to the default) the named limits, and/or
        disable or enable. None if there is no such tenant.

        ``source_if_new``: a tenant that exists without a row (``HERALD_API_KEYS``'s) gets one
        with that source, in the same transaction, to carry the change. Only the change is
        audited (``tenant.updated`` or ``tenant.disabled``), never a ``tenant.created``: the
        tenant was not created, it was there already."""
        ...

    async def create_key(self, key: KeyRow) -> KeyRow: ...

    async def list_keys(self, tenant_id: str) -> list[KeyRow]:
        """The tenant's unrevoked keys, oldest first."""
        ...

    async def get_key(self, key_id: str) -> KeyRow | None:
        """An unrevoked key."""
        ...

    async def revoke_key(self, key_id: str) -> KeyRow | None:
        """None if there is no such unrevoked key."""
        ...

    async def touch_keys(self, used_at: Mapping[str, float]) -> None:
        """Record when keys were last used (callers batch this: at most once a minute a key)."""
        ...

    async def audit_log(self, *, before: int | None, limit: int) -> list[AuditRow]:
        """Newest first; ``before`` is an earlier answer's row id (as int)."""
        ...


class DeliveryQueue(Protocol):
    """The durable schedule of webhook deliveries, shared by any number of notifiers."""

    async def fan_out(self, events: Sequence[JobEvent]) -> FannedOut:
        """Record the deliveries of ``events`` (one per matching endpoint, one for the job's
        callback URL) in one transaction, idempotent per target and event; each placed as
        ``herald.delivery_rules.place`` says (superseding, progress slots). Each tenant's events
        add at most its share (``herald.delivery_rules.share_fan_out``): the rest, and all
        events of a tenant that has some waiting, are recorded to wait for ``drain_waiting``.
        Returns how many deliveries are pending and how many events wait."""

    async def drain_waiting(self, after: str | None = None) -> Drained:
        """Fan out, in one transaction, the oldest waiting events of the next tenants with some
        waiting after ``after`` (by id, wrapping round: the waiting tenants take turns, so one
        that spilled once never queues behind another's backlog), each tenant's up to its share;
        any number of notifiers may call it at once, and a tenant's events are fanned out in
        the order they came."""

    async def fan_out_leasing(self, events: Sequence[JobEvent], offer: LeaseOffer) -> FannedOut:
        """``fan_out``, and in the same transaction ``claim`` (with ``offer``'s arguments) among the
        targets it recorded deliveries for: what is due at once goes out without a claim of its
        own. The notifier offers this only while it has claimed everything due it could
        (no backlog), so what it leases here jumps no queue, and never waits on a walk of
        other targets' backlogs (another tenant's, most of all)."""

    async def anything_due(self, held: Collection[str] = ()) -> bool:
        """Whether a claim could lease something now: a due pending delivery nobody holds whose
        target is not one of ``held`` (the claim leaves those out). It reads at most
        ``DUE_PROBE_ROWS`` due rows; when that many are due it says yes without looking
        further, so a held target's large backlog costs a bounded read and never hides
        another target's due delivery."""

    async def next_due_after(self, at: float) -> float | None: ...

    async def claim(
        self, owner: str, *, lease_s: float, per_target: int, limit: int, in_flight: Mapping[str, int],
        per_tenant: int = 0, tenant_in_flight: Mapping[str, int] | None = None, held: Collection[str] = (),
    ) -> list[Claimed]:
        """Lease up to ``limit`` due deliveries nobody holds, at most ``per_target`` in flight per
        target (``in_flight``: what this notifier has; a target counted below zero gets that much
        more room, as the notifier's window for it is wider: ``notifier.window``) and ``per_tenant`` per tenant
        (``tenant_in_flight``; 0: no cap), none of the ``held`` targets, never one whose older
        version of the same job is still pending; each with its job's trace context
        (``Claimed.trace_context``), read in the same query.

        Fair (SPEC §13): the slots go to the tenant with the fewest in flight first, and within a
        tenant round robin over its targets; oldest first only among equals. So a tenant's backlog
        never stands before another tenant's due delivery."""

    async def defer(self, delivery_ids: Sequence[str], owner: str, targets: Sequence[str], delay_s: float) -> None:
        """Reschedule without counting an attempt (a paced target, SPEC §13): the leased
        ``delivery_ids`` are handed back due in ``delay_s``, and every due, unleased pending
        delivery of ``targets`` is moved to then as well."""

    async def finish(self, claimed: Claimed, owner: str, started_at: float, outcome: Outcome, plan: Plan) -> Finished:
        """Record the attempt and settle it (``herald.delivery_rules.settle``) in one transaction.
        When it disables the endpoint, the endpoint's other pending deliveries fail (but those in
        flight, which their own attempts settle) and this one keeps its attempt count. ``dropped``: the delivery was deleted meanwhile."""

    async def finish_many(self, attempts: Sequence[Attempted], owner: str) -> list[Finished]:
        """``finish`` for each of ``attempts``, in order, all in one transaction: every attempt and
        its consequence is committed when this returns, or nothing is (it raised). The notifier
        records the attempts that finished together this way (``notifier.recorder``)."""

    async def release(self, delivery_ids: Sequence[str], owner: str) -> None: ...

    async def renew(self, delivery_ids: Sequence[str], owner: str, lease_s: float) -> None:
        """Extend ``owner``'s leases of these deliveries to ``lease_s`` from now: those still
        pending and still its own (a lease that ran out and was taken, or a delivery settled
        meanwhile, is left as it is)."""

    async def prune(self, finished_before: float, limit: int = 1000) -> int:
        """Forget up to ``limit`` deliveries that ended before ``finished_before`` (the count),
        and fail up to ``limit`` pending deliveries of disabled endpoints that are not in flight
        (``delivery_rules.fails_with_its_endpoint``: their attempt was never recorded)."""


@dataclass(frozen=True, slots=True)
class ResultBody:
    """A stored result, ready to stream: its size and its bytes in chunks."""

    size: int
    chunks: AsyncIterator[bytes]


class ResultStore(Protocol):
    """Where finished results live. A handler writes a local scratch file; ``commit`` makes it
    the job's result (durable, visible to every gateway) before the job is marked succeeded."""

    def scratch_path(self, job_id: str, attempt: int, suffix: str) -> Path:
        """A local file for an attempt to write while it runs. Never visible as a result."""

    async def commit(self, job_id: str, attempt: int, scratch: Path) -> str:
        """Store the finished scratch file as the result; returns the key kept on the job."""

    async def open(self, key: str) -> ResultBody | None:
        """The result's bytes, streamed; None if it is gone."""

    async def discard(self, key: str) -> None:
        """Remove a committed result that lost its race (the job did not succeed with it)."""

    async def delete_job(self, job_id: str) -> None:
        """Remove every result of the job (retention)."""

    async def close(self) -> None: ...


@dataclass(slots=True)
class Storage:
    """The store of record as one process sees it: its three ports share one database
    (connection, pool), which ``jobs.close()`` closes."""

    jobs: JobStore
    webhooks: WebhookStore
    deliveries: DeliveryQueue
    tenants: TenantStore
    sealer: Sealer  # what seals the store's secrets; also names env keys (herald.tenants.env_key_id)

    async def close(self) -> None:
        await self.jobs.close()
