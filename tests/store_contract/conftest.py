"""The store contract's fixture: every port of one backend, on a database of the test's own.

``stores`` is parametrised over the backends ``--stores`` names (``sqlite`` and
``postgres`` by default, the same session-scoped ``store`` parameter the deployment tests
use, so tests group by backend). Each test gets the ports ``herald.storage.build_storage``
makes for the settings a deployment would use: a real SQLite file in the test's temp dir,
or a new database on the session's PostgreSQL server (one server per test process), copied
from a template the session migrated once (``CREATE DATABASE ... TEMPLATE``: a file copy,
instead of a psql process and every migration per test).
"""

from __future__ import annotations

import re
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from herald.settings import Settings
from herald.storage import build_storage
from herald.storage.ports import DeliveryQueue, JobStore, Storage, TenantStore, WebhookStore
from launcher.pgserver import PostgresServer
from tests.harness import SECRET_KEY, new_database

RETENTION_S = 60.0


class Stores:
    """One backend's ports over one database, as one process opens them, plus what a test
    needs around them: more processes on the same database (``another``), and a back door
    (``sql``) for what no port exposes (moving a stored time into the past, counting rows)."""

    def __init__(self, backend: str, settings: Settings) -> None:
        self.backend = backend
        self.settings = settings
        self.storage = build_storage(settings)
        self._others: list[Storage] = []
        self._pg: asyncpg.Connection | None = None
        self._sqlite: sqlite3.Connection | None = None

    @property
    def jobs(self) -> JobStore:
        return self.storage.jobs

    @property
    def webhooks(self) -> WebhookStore:
        return self.storage.webhooks

    @property
    def deliveries(self) -> DeliveryQueue:
        return self.storage.deliveries

    @property
    def tenants(self) -> TenantStore:
        return self.storage.tenants

    async def another(self, **settings: Any) -> Storage:
        """Another process's ports on the same database (its own pool, or its own SQLite
        connections and writer), opened; with ``settings`` changed (``retention_s=0.0``)."""
        other = build_storage(Settings(**{**self._fields(), **settings}))
        await other.jobs.open()
        self._others.append(other)
        return other

    async def sql(self, query: str, *args: Any) -> list[dict[str, Any]]:
        """Run one statement outside the ports, written with PostgreSQL's ``$1`` placeholders
        (the tables are named alike in both backends); its rows as dicts."""
        if self.backend == "postgres":
            if self._pg is None:
                assert self.settings.database_url is not None
                self._pg = await asyncpg.connect(self.settings.database_url)
            return [dict(r) for r in await self._pg.fetch(query, *args)]
        if self._sqlite is None:
            from herald.storage.sqlite.db import connect

            self._sqlite = connect(self.settings.db_path)
        return [dict(r) for r in self._sqlite.execute(re.sub(r"\$(\d+)", r"?\1", query), args).fetchall()]

    async def count(self, table: str, where: str = "TRUE", *args: Any) -> int:
        [row] = await self.sql(f"SELECT count(*) AS n FROM {table} WHERE {where}", *args)
        return int(row["n"])

    def _fields(self) -> dict[str, Any]:
        return {"data_dir": self.settings.data_dir, "database_url": self.settings.database_url,
                "secret_keys": self.settings.secret_keys, "retention_s": self.settings.retention_s}

    async def close(self) -> None:
        if self._pg is not None:
            await self._pg.close()
        if self._sqlite is not None:
            self._sqlite.close()
        for other in self._others:
            await other.close()
        await self.storage.close()


class _Databases:
    """New PostgreSQL databases, each a copy of one this process migrated once."""

    def __init__(self, admin: asyncpg.Connection, template: str, url: Any) -> None:
        self._admin = admin
        self._template = template
        self._url = url

    async def new(self) -> str:
        name = f"contract_{uuid.uuid4().hex[:16]}"
        await self._admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self._template}"')
        return str(self._url(name))


@pytest.fixture(scope="session")
async def pg_databases(store_server: PostgresServer | None) -> AsyncIterator[_Databases | None]:
    """The template: a database the ports opened (every migration applied), then closed (a
    template takes no other connection while it is copied)."""
    if store_server is None:
        yield None
        return
    template_url = new_database(store_server)
    storage = build_storage(Settings(database_url=template_url, secret_keys=(SECRET_KEY,)))
    await storage.jobs.open()
    await storage.close()
    admin = await asyncpg.connect(store_server.url("postgres"))
    try:
        yield _Databases(admin, template_url.rsplit("/", 1)[1], store_server.url)
    finally:
        await admin.close()


@pytest.fixture()
async def stores(store: str, pg_databases: _Databases | None, tmp_path: Path) -> AsyncIterator[Stores]:
    """The backend's ports, opened on a database of this test's own."""
    settings = Settings(data_dir=tmp_path / "data", secret_keys=(SECRET_KEY,), retention_s=RETENTION_S,
                        database_url=await pg_databases.new() if pg_databases is not None else None)
    opened = Stores(store, settings)
    await opened.jobs.open()
    try:
        yield opened
    finally:
        await opened.close()
