"""The PostgreSQL schema: ``sql/NNNN_*.sql`` beside this module, applied by ``herald.storage.migrations``.

Before the runner, each migration was recorded by name in ``herald_migrations``; such a
database is adopted by mapping those names onto the files that carry the same SQL (the
table stays, unread, so that a Herald of that time started against it again finds nothing
to do).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from herald.deliveries import CALLBACK_PREFIX
from herald.storage.migrations import Migration, Schema, Session, load
from herald.storage.postgres.db import NOW_SQL
from herald.storage.postgres.webhooks import KEY_LOCK_CLASS, ORDER_LOCK_CLASS

# The constants the SQL files name in braces.
SQL_PARAMS = {"now": NOW_SQL, "key_lock": KEY_LOCK_CLASS, "order_lock": ORDER_LOCK_CLASS,
              "callback_prefix": CALLBACK_PREFIX}

# herald_migrations' names -> the version that carries that migration's SQL now.
LEGACY_NAMES = {
    "jobs-1": 1,
    "jobs-trace-context": 2,
    "jobs-queued-by-kind": 3,
    "outbox-origin": 4,
    "jobs-tenant-fair-share": 5,
    "jobs-events-numbered-after-commit": 13,  # in the order that code applied them
    "webhooks-1-tables": 6,
    "webhooks-1-functions": 7,
    "webhooks-2-finish-many": 8,
    "webhooks-3-claim-by-target": 9,
    "webhooks-4-fair-claim": 10,
    "webhooks-5-claim-skips-capped-tenants": 12,
    "tenants-1": 11,
}


async def adopt(session: Session, migrations: Sequence[Migration]) -> Collection[int]:
    """The versions a database made before the runner has: those its ``herald_migrations`` names."""
    [(legacy,)] = await session.fetch("SELECT to_regclass('herald_migrations') IS NOT NULL")
    if not legacy:
        return ()
    names = {name for (name,) in await session.fetch("SELECT name FROM herald_migrations")}
    return {LEGACY_NAMES[name] for name in names if name in LEGACY_NAMES}


SCHEMA = Schema(load("herald.storage.postgres", SQL_PARAMS), adopt)
