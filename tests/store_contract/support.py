"""What the contract's cases build their inputs from: jobs, events, endpoints, claims."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Collection
from typing import Any

import msgspec

from herald.deliveries import Claimed, Finished, Outcome, Plan
from herald.jobs import IdempotencyClaim, JobRow, NewJob
from herald.storage.ports import DeliveryQueue, JobStore, OutboxRow, WebhookStore
from herald.transitions import Change
from schemas import JobEvent

CLAIM = Change(expect={"queued"}, to="running", claim=True)
ALL_TYPES = ("job.queued", "job.running", "job.progress", "job.succeeded", "job.failed", "job.cancelled")
OK = Outcome(status_code=200, latency_s=0.012)
FAILED = Outcome(status_code=500, latency_s=0.02, error="HTTP 500", response=b"boom")
GONE = Outcome(status_code=410, latency_s=0.01)


def new_job(tenant: str = "t1", *, deadline_s: float = 600.0, callback_url: str | None = None,
            job_id: str | None = None) -> NewJob:
    return NewJob(
        id=job_id or uuid.uuid4().hex, tenant=tenant, kind="report", collection="/reports",
        params=b'{"title":"t","pages":2}', deadline_s=deadline_s, callback_url=callback_url,
    )


def claim_key(key: str, fingerprint: str = "POST /reports {}") -> IdempotencyClaim:
    return IdempotencyClaim(key=key, fingerprint=fingerprint, ttl_s=3600.0)


async def running_job(jobs: JobStore, tenant: str = "t1") -> JobRow:
    accepted = await jobs.accept(new_job(tenant))
    return (await jobs.transition(accepted.job.id, CLAIM)).after


async def relay_pass(jobs: JobStore, *, everyone: bool = False) -> list[OutboxRow]:
    """What a relay's pass does to the store (``herald.relay``), the publishing left out: the
    rows this process committed (or, ``everyone``, any process's), their events numbered
    (``ports.py``, "Ordered history"), then deleted as published. The rows, in batch order."""
    rows = await jobs.outbox_batch(10_000, stale_after_s=0.0 if everyone else None)
    await jobs.outbox_done([r.seq for r in rows])
    return rows


async def outcomes(calls: list[Awaitable[Any]]) -> list[Any]:
    """Run the calls at once; results and exceptions side by side."""
    return await asyncio.gather(*calls, return_exceptions=True)


def event(job_id: str, version: int, type: str = "job.succeeded", *, tenant: str = "t1",
          kind: str = "echo") -> JobEvent:
    """A job's event as the job store committed it (the notifier fans these out)."""
    data = msgspec.json.encode({"id": job_id, "version": version})
    return JobEvent(seq=version, tenant=tenant, job_id=job_id, kind=kind, version=version, type=type,
                    at="2026-01-01T00:00:00Z", data=msgspec.Raw(data))


async def endpoint(webhooks: WebhookStore, tenant: str = "t1", **options: Any) -> str:
    """A new endpoint's id: every event type of every kind, HMAC-signed, unless ``options`` say otherwise."""
    options.setdefault("url", "https://example.com/hook")
    options.setdefault("event_types", ALL_TYPES)
    options.setdefault("kinds", None)
    options.setdefault("signature", "hmac-sha256")
    row, _ = await webhooks.create_endpoint(tenant, **options)
    return row.id


async def claim(queue: DeliveryQueue, owner: str = "n1", *, per_target: int = 10, limit: int = 100,
                lease_s: float = 30.0, in_flight: dict[str, int] | None = None, per_tenant: int = 0,
                tenant_in_flight: dict[str, int] | None = None, held: Collection[str] = ()) -> list[Claimed]:
    return await queue.claim(owner, lease_s=lease_s, per_target=per_target, limit=limit, in_flight=in_flight or {},
                             per_tenant=per_tenant, tenant_in_flight=tenant_in_flight, held=held)


async def deliveries(stores: Any, **where: Any) -> list[dict[str, Any]]:
    """The delivery rows as stored (``webhook_deliveries``, in seq order), matching ``where``."""
    clauses = " AND ".join(f"{k} = ${n}" for n, k in enumerate(where, start=1)) or "TRUE"
    return await stores.sql(f"SELECT * FROM webhook_deliveries WHERE {clauses} ORDER BY seq", *where.values())


async def finish(stores: Any, item: Claimed, outcome: Outcome, plan: Plan, owner: str = "n1") -> Finished:
    """``finish`` with the attempt started now, on the store's clock."""
    return await stores.deliveries.finish(item, owner, await stores.jobs.clock(), outcome, plan)


# Where the backends still answer differently: each one is stated as allowed in
# herald/storage/ports.py. A case that meets one asserts each backend's own answer through
# ``differs``, so that removing a difference is deleting its line here and the branch in the case.
KNOWN_DIFFERENCES: dict[str, str] = {}


def differs(stores: Any, difference: str) -> bool:
    """Whether this backend is the one of ``KNOWN_DIFFERENCES[difference]``."""
    return bool(stores.backend == KNOWN_DIFFERENCES[difference])
