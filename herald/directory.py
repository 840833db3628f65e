"""The tenant directory: every process's cached view of tenants, keys and limits (SPEC §12).

Authentication must not cost a store read per request, yet a revoked key must stop
working everywhere within 2 s. So each process (gateway, worker, notifier) keeps the
whole directory in memory, a few hundred bytes per key, and replaces it whenever the
store's directory ``version`` moves:

* **Broadcast.** After a change, the gateway that made it publishes on
  ``herald.directory.changed`` (core NATS); every process's subscription wakes its
  refresh at once: a change holds everywhere in milliseconds.
* **Bounded age.** Independently, every ``HERALD_DIRECTORY_REFRESH_S`` (1 s) each process
  reads the version (one row) and reloads if it moved, so a lost broadcast (NATS down, a
  process reconnecting) heals by itself within that bound.

Keys are checked in constant time: an issued key (``hk_<id>_<secret>``) is found by its id
and its secret compared by hash; ``HERALD_API_KEYS`` keys are compared against every one
of them by hash. ``last_used_at`` is written at most once a minute per key and process, in
batches, never on the request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from herald.jobs import StoreUnavailable
from herald.settings import Settings
from herald.sealing import Sealer
from herald.storage.ports import Storage, TenantStore
from herald.tasks import TaskOwner, until_done
from herald.tenants import (
    ALL_SCOPES, SOURCE_ENV, DirectorySnapshot, KeyRow, Limits, TenantRow, env_keys, key_digest, split_key,
)

log = logging.getLogger("herald.directory")

CHANGED_SUBJECT = "herald.directory.changed"
LAST_USED_RESOLUTION_S = 60.0  # SPEC §12: last_used_at to the minute, written at most once a minute


@dataclass(frozen=True, slots=True)
class StreamOwner:
    """Whom a held stream or long poll was opened for: the tenant and the key (None: a signed
    link, which names the tenant only). It lasts while ``Directory.stream_allowed`` says so."""

    directory: Directory
    tenant: str
    key_id: str | None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: the tenant, the key it used, what that key may do."""

    tenant: str
    key_id: str
    scopes: frozenset[str]


class Directory:
    def __init__(self, settings: Settings, store: TenantStore, sealer: Sealer) -> None:
        self._store = store
        self._refresh_s = settings.directory_refresh_s
        self._defaults = Limits.defaults(settings)
        self._env_keys = env_keys(settings, sealer)
        self._env_tenants = {key.tenant for key in self._env_keys}
        self.version = -1
        self._tenants: dict[str, TenantRow] = {}
        self._keys: dict[str, KeyRow] = {}
        self._limits: dict[str, Limits] = {}
        self._wake = asyncio.Event()
        self._used: dict[str, float] = {}  # key id -> when, not yet written
        self._written: dict[str, float] = {}  # key id -> when last written by this process
        self._subscription: Subscription | None = None
        # Held streams (SSE, a live output) and long polls, each ended once its key is revoked or
        # expires or its tenant is disabled: checked after every reload, and on every tick while a
        # key can expire.
        self._streams: dict[int, tuple[str, str | None, Callable[[], None]]] = {}
        self._stream_handles = itertools.count()
        self._expiring = False

    # ----- loading -------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.version >= 0

    async def refresh(self, *, force: bool = False) -> bool:
        """Reload if the store's version moved (or ``force``); True if it did reload."""
        if not force and self.loaded and await self._store.directory_version() == self.version:
            return False
        self.install(await self._store.snapshot())
        return True

    def install(self, snapshot: DirectorySnapshot) -> None:
        if snapshot.version < self.version:
            return  # an older read finishing late
        tenants = {row.id: row for row in snapshot.tenants}
        self._tenants = tenants
        self._keys = {key.id: key for key in snapshot.keys}
        self._limits = {row.id: row.effective_limits(self._defaults) for row in tenants.values()}
        self._expiring = any(key.expires_at is not None for key in snapshot.keys)
        self.version = snapshot.version
        self._end_disallowed_streams()

    async def run(self) -> None:
        """Refresh on every broadcast and at least every ``HERALD_DIRECTORY_REFRESH_S``;
        write the batched ``last_used_at`` times."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._refresh_s)
            self._wake.clear()
            try:
                if not await self.refresh() and self._expiring:
                    self._end_disallowed_streams()
                await self._flush_used()
            except StoreUnavailable as exc:
                log.warning("tenant directory not refreshed: %s", exc)
            except Exception:
                log.exception("tenant directory refresh failed; retrying")

    async def attach(self, nc: NATS) -> None:
        async def changed(_msg: Msg) -> None:
            self._wake.set()

        self._subscription = await nc.subscribe(CHANGED_SUBJECT, cb=changed)

    async def detach(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None

    @staticmethod
    async def announce(nc: NATS | None) -> None:
        """Tell every process that the directory changed (best effort: the bounded age heals a miss)."""
        if nc is None or not nc.is_connected:
            return
        with contextlib.suppress(Exception):
            await nc.publish(CHANGED_SUBJECT, b"")
            await nc.flush(timeout=1)

    # ----- questions -----------------------------------------------------------------------

    def authenticate(self, token: str) -> Principal | None:
        """The principal of a bearer token, or None (unknown, revoked, expired, or its tenant disabled)."""
        split = split_key(token)
        if split is not None:
            key_id, secret = split
            key = self._keys.get(key_id)
            digest = key_digest(secret)
            if key is None or not hmac.compare_digest(key.digest, digest):
                return None
            if key.expired(time.time()):
                return None
        else:
            digest = key_digest(token)
            key = None
            # Every env key is compared, so the time taken does not say which one matched.
            for candidate in self._env_keys:
                if hmac.compare_digest(candidate.digest, digest):
                    key = candidate
            if key is None:
                return None
        if self.disabled(key.tenant):
            return None
        if key.source != SOURCE_ENV:
            self._note_used(key.id)
        return Principal(tenant=key.tenant, key_id=key.id, scopes=frozenset(key.scopes))

    def key_live(self, key_id: str, tenant: str) -> bool:
        """The key exists, is not revoked or expired, belongs to ``tenant``, whose tenant is enabled."""
        key = self._keys.get(key_id) or next((k for k in self._env_keys if k.id == key_id), None)
        return (key is not None and key.tenant == tenant and not key.expired(time.time())
                and not self.disabled(tenant))

    def stream_allowed(self, tenant: str, key_id: str | None) -> bool:
        """Whether a stream opened with this key (None: a signed link) may go on."""
        return not self.disabled(tenant) if key_id is None else self.key_live(key_id, tenant)

    def hold_stream(self, owner: StreamOwner, end: Callable[[], None]) -> int:
        """Call ``end`` (once) when ``owner`` may no longer stream; a handle for ``release_stream``."""
        handle = next(self._stream_handles)
        self._streams[handle] = (owner.tenant, owner.key_id, end)
        return handle

    def release_stream(self, handle: int) -> None:
        self._streams.pop(handle, None)

    def _end_disallowed_streams(self) -> None:
        ended = [handle for handle, (tenant, key_id, _end) in self._streams.items()
                 if not self.stream_allowed(tenant, key_id)]
        for handle in ended:
            _tenant, _key_id, end = self._streams.pop(handle)
            end()
        if ended:
            log.info("held streams and polls ended: their key was revoked or expired, or their tenant disabled",
                     extra={"streams": len(ended)})

    def disabled(self, tenant: str) -> bool:
        row = self._tenants.get(tenant)
        return row is not None and row.disabled

    def exists(self, tenant: str) -> bool:
        return tenant in self._tenants or tenant in self._env_tenants

    def is_env_tenant(self, tenant: str) -> bool:
        return tenant in self._env_tenants

    def limits(self, tenant: str) -> Limits:
        return self._limits.get(tenant, self._defaults)

    @property
    def defaults(self) -> Limits:
        return self._defaults

    def env_keys_of(self, tenant: str) -> list[KeyRow]:
        return [key for key in self._env_keys if key.tenant == tenant]

    def env_key(self, key_id: str) -> KeyRow | None:
        return next((key for key in self._env_keys if key.id == key_id), None)

    @property
    def env_tenants(self) -> frozenset[str]:
        return frozenset(self._env_tenants)

    # ----- last use ------------------------------------------------------------------------

    def _note_used(self, key_id: str) -> None:
        at = time.time()
        if at - self._written.get(key_id, 0.0) >= LAST_USED_RESOLUTION_S:
            self._written[key_id] = at
            self._used[key_id] = at

    async def _flush_used(self) -> None:
        if not self._used:
            return
        used, self._used = self._used, {}
        try:
            await self._store.touch_keys(used)
        except BaseException:
            for key_id, at in used.items():  # next time
                self._used.setdefault(key_id, at)
            raise


@asynccontextmanager
async def running_directory(settings: Settings, storage: Storage, nc: NATS | None) -> AsyncIterator[Directory]:
    """A loaded directory that follows changes (broadcast and bounded age) while the block runs:
    for the worker and notifier processes, which enforce tenants' limits."""
    directory = Directory(settings, storage.tenants, storage.sealer)
    await until_done(lambda: directory.refresh(force=True), "reading the tenant directory", log)
    async with TaskOwner() as owner:
        if nc is not None:
            await directory.attach(nc)
            owner.push_async_callback(directory.detach)
        owner.spawn(directory.run(), "tenant-directory")
        yield directory


__all__ = ["ALL_SCOPES", "CHANGED_SUBJECT", "Directory", "Principal", "StreamOwner"]
