"""The tenant directory's contract (``herald.storage.ports.TenantStore``), on every backend.

Every change bumps the directory's version and appends its audit row in the same
transaction, so a process that sees a new version and re-reads the snapshot sees the
change, and no change goes unaudited. Key digests only; the plaintext never reaches the
store (``herald.tenants``).
"""

from __future__ import annotations

import asyncio

from herald.tenants import (
    KEY_CREATED,
    KEY_REVOKED,
    SOURCE_ENV,
    TENANT_CREATED,
    TENANT_DISABLED,
    TENANT_UPDATED,
    KeyRow,
)
from tests.store_contract.conftest import Stores
from tests.store_contract.support import outcomes


def new_key(key_id: str, tenant: str = "acme", *, expires_at: float | None = None) -> KeyRow:
    return KeyRow(id=key_id, tenant=tenant, name=f"{key_id}'s name", scopes=("jobs:read", "webhooks"),
                  digest=key_id.encode().ljust(32, b"\0"), created_at=0.0, expires_at=expires_at)


async def test_tenants_created_listed_and_updated_each_change_audited_under_a_new_version(stores: Stores) -> None:
    tenants = stores.tenants
    start = await tenants.directory_version()
    before = await stores.jobs.clock()
    acme = await tenants.create_tenant("acme", {"rate_limit": 5.0})
    assert acme is not None and (acme.id, acme.disabled, dict(acme.limits), acme.source) == (
        "acme", False, {"rate_limit": 5.0}, "api")
    assert before <= acme.created_at <= await stores.jobs.clock()
    assert await tenants.create_tenant("acme", {}) is None  # the id is taken: no change
    assert await tenants.directory_version() == start + 1
    await tenants.create_tenant("globex", {}, source=SOURCE_ENV, disabled=True)
    assert await tenants.get_tenant("acme") == acme
    assert await tenants.get_tenant("nobody") is None

    # By id, those after ``after``.
    assert [t.id for t in await tenants.list_tenants(after=None, limit=10)] == ["acme", "globex"]
    assert [t.id for t in await tenants.list_tenants(after="acme", limit=10)] == ["globex"]
    assert [t.id for t in await tenants.list_tenants(after=None, limit=1)] == ["acme"]

    # A value sets a limit, None returns it to the default; names that are no limits are ignored.
    updated = await tenants.update_tenant("acme", limits={"max_running": 2, "rate_limit": None, "colour": 1},
                                          disabled=None)
    assert updated is not None and dict(updated.limits) == {"max_running": 2} and not updated.disabled
    assert await tenants.get_tenant("acme") == updated
    disabled = await tenants.update_tenant("acme", limits=None, disabled=True)
    assert disabled is not None and disabled.disabled and dict(disabled.limits) == {"max_running": 2}
    assert await tenants.update_tenant("nobody", limits={"max_running": 1}, disabled=True) is None
    assert await tenants.directory_version() == start + 4

    # Newest first, paged by an earlier answer's id; every change has its row.
    log = await tenants.audit_log(before=None, limit=10)
    assert [(r.action, r.tenant, r.key_id) for r in log] == [
        (TENANT_DISABLED, "acme", None), (TENANT_UPDATED, "acme", None),
        (TENANT_CREATED, "globex", None), (TENANT_CREATED, "acme", None)]
    assert dict(log[-1].detail) == {"limits": {"rate_limit": 5.0}, "source": "api"}
    assert [r.id for r in await tenants.audit_log(before=int(log[1].id), limit=10)] == [r.id for r in log[2:]]
    assert [r.id for r in await tenants.audit_log(before=None, limit=2)] == [r.id for r in log[:2]]
    assert all(before <= r.at for r in log) and [r.at for r in log] == sorted((r.at for r in log), reverse=True)


async def test_a_tenant_without_a_row_gets_one_with_its_first_change_audited_as_that_change(stores: Stores) -> None:
    """A HERALD_API_KEYS tenant has no row until the API first changes it: the row comes with
    that change, in its transaction, audited as the change (the tenant was not created)."""
    tenants = stores.tenants
    start = await tenants.directory_version()
    disabled = await tenants.update_tenant("globex", limits=None, disabled=True, source_if_new=SOURCE_ENV)
    assert disabled is not None and (disabled.disabled, dict(disabled.limits), disabled.source) == (True, {}, SOURCE_ENV)
    again = await tenants.update_tenant("globex", limits={"max_running": 2}, disabled=None, source_if_new=SOURCE_ENV)
    assert again is not None and again.disabled and dict(again.limits) == {"max_running": 2}
    assert await tenants.get_tenant("globex") == again
    assert await tenants.update_tenant("nobody", limits=None, disabled=True) is None  # no source: no row
    assert await tenants.directory_version() == start + 2
    log = await tenants.audit_log(before=None, limit=10)
    assert [(r.action, r.tenant, dict(r.detail)) for r in log] == [
        (TENANT_UPDATED, "globex", {"limits": {"max_running": 2}}), (TENANT_DISABLED, "globex", {"disabled": True})]


async def test_keys_are_created_listed_and_revoked_each_change_audited(stores: Stores) -> None:
    tenants = stores.tenants
    await tenants.create_tenant("acme", {})
    start = await tenants.directory_version()
    first = await tenants.create_key(new_key("k1"))
    second = await tenants.create_key(new_key("k2", expires_at=4_000_000_000.0))
    await tenants.create_key(new_key("k3", tenant="globex"))
    assert first.created_at > 0 and (first.id, first.tenant, first.scopes, first.digest) == (
        "k1", "acme", ("jobs:read", "webhooks"), new_key("k1").digest)  # the store's time, the digest kept
    assert second.expires_at == 4_000_000_000.0 and first.last_used_at is None
    assert await tenants.get_key("k1") == first
    assert [k.id for k in await tenants.list_keys("acme")] == ["k1", "k2"]  # oldest first

    await tenants.touch_keys({"k1": 1_700_000_000.0})
    revoked = await tenants.revoke_key("k1")
    assert revoked is not None and revoked.id == "k1"
    assert await tenants.revoke_key("k1") is None and await tenants.revoke_key("nope") is None
    assert await tenants.get_key("k1") is None
    assert [k.id for k in await tenants.list_keys("acme")] == ["k2"]
    assert await tenants.directory_version() == start + 4
    log = await tenants.audit_log(before=None, limit=4)
    assert [(r.action, r.tenant, r.key_id) for r in log] == [
        (KEY_REVOKED, "acme", "k1"), (KEY_CREATED, "globex", "k3"), (KEY_CREATED, "acme", "k2"),
        (KEY_CREATED, "acme", "k1")]
    # The revocation keeps the key's last recorded use: its listing no longer shows it.
    assert dict(log[0].detail) == {"name": revoked.name, "last_used_at": "2023-11-14T22:13:20.000Z"}

    # Last use is not a directory change: no version, no audit row; never moves back.
    await tenants.touch_keys({"k2": 2000.0, "k3": 1000.0})
    await tenants.touch_keys({"k2": 1500.0})
    await tenants.touch_keys({})
    assert (await tenants.get_key("k2")).last_used_at == 2000.0  # type: ignore[union-attr]
    assert (await tenants.get_key("k3")).last_used_at == 1000.0  # type: ignore[union-attr]
    assert await tenants.directory_version() == start + 4
    assert len(await tenants.audit_log(before=None, limit=100)) == 5  # the tenant's creation and the four

    snapshot = await tenants.snapshot()
    assert snapshot.version == start + 4
    assert [t.id for t in snapshot.tenants] == ["acme"]
    assert sorted(k.id for k in snapshot.keys) == ["k2", "k3"]  # unrevoked only


async def test_changes_from_two_processes_each_get_a_version_and_a_snapshot_sees_them(stores: Stores) -> None:
    """Concurrent changes at two gateways: one creation per id, every change its own version
    and audit row, and a snapshot at a version shows every change up to it."""
    a, b = stores.tenants, (await stores.another()).tenants
    start = await a.directory_version()
    created = await outcomes([(a if n % 2 else b).create_tenant("same", {}) for n in range(10)])
    assert not [c for c in created if isinstance(c, BaseException)], created
    assert len([c for c in created if c is not None]) == 1
    await asyncio.gather(*((a if n % 2 else b).create_tenant(f"t{n:02}", {}) for n in range(20)),
                         *((b if n % 2 else a).create_key(new_key(f"k{n:02}", tenant="same")) for n in range(20)))
    assert await b.directory_version() == start + 41
    assert len(await a.audit_log(before=None, limit=100)) == 41
    snapshot = await b.snapshot()
    assert snapshot.version == start + 41
    assert len(snapshot.tenants) == 21 and len(snapshot.keys) == 20
