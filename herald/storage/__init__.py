"""Storage: the ports (``ports``) and the backend chosen by the settings.

SQLite under ``HERALD_DATA_DIR`` unless ``HERALD_DATABASE_URL`` names a PostgreSQL
database. The backends are imported only when chosen, so a SQLite deployment never
loads asyncpg and a PostgreSQL one never opens a local file.
"""

from __future__ import annotations

from herald.sealing import load_sealer
from herald.settings import Settings
from herald.storage.ports import Storage


def build_storage(settings: Settings) -> Storage:
    """The backend's three ports over one database; call ``await storage.jobs.open()`` next.

    Every secret they keep is sealed with ``HERALD_SECRET_KEY`` (``herald.sealing``); a
    PostgreSQL store without it raises ``SettingsError`` naming the variable."""
    sealer = load_sealer(settings)
    if settings.database_url is not None:
        from herald.storage.postgres import jobs as pg_jobs
        from herald.storage.postgres import tenants as pg_tenants
        from herald.storage.postgres import webhooks as pg_webhooks
        from herald.storage.postgres.db import PgDatabase
        from herald.storage.postgres.schema import SCHEMA as PG_SCHEMA

        pg = PgDatabase(settings.database_url, PG_SCHEMA)
        return Storage(
            jobs=pg_jobs.PgJobStore(pg, retention_s=settings.retention_s, sealer=sealer),
            webhooks=pg_webhooks.PgWebhookStore(pg, sealer),
            deliveries=pg_webhooks.PgDeliveryQueue(pg, sealer),
            tenants=pg_tenants.PgTenantStore(pg),
            sealer=sealer,
        )

    from herald.storage.sqlite import jobs as sqlite_jobs
    from herald.storage.sqlite import queue as sqlite_queue
    from herald.storage.sqlite import tenants as sqlite_tenants
    from herald.storage.sqlite import webhooks as sqlite_webhooks
    from herald.storage.sqlite.db import Database
    from herald.storage.sqlite.schema import SCHEMA as SQLITE_SCHEMA

    db = Database(settings.db_path, SQLITE_SCHEMA)
    return Storage(
        jobs=sqlite_jobs.SqliteJobStore(db, retention_s=settings.retention_s, sealer=sealer),
        webhooks=sqlite_webhooks.SqliteWebhookStore(db, sealer),
        deliveries=sqlite_queue.SqliteDeliveryQueue(db, sealer),
        tenants=sqlite_tenants.SqliteTenantStore(db),
        sealer=sealer,
    )


async def open_storage(settings: Settings) -> Storage:
    """Build and open (connect, create or migrate the schema)."""
    storage = build_storage(settings)
    await storage.jobs.open()
    return storage
