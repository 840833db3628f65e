"""The PostgreSQL schema: ``sql/NNNN_*.sql`` and the functions, ``sql/functions/*.sql``,
beside this module, applied by ``herald.storage.migrations``.

Before the runner, each migration was recorded by name in ``herald_migrations``; such a
database is adopted by mapping those names onto the files that carry the same SQL (the
table stays, unread, so that a Herald of that time started against it again finds nothing
to do).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from herald.constants import NOTIFY, QUIET
from herald.deliveries import CALLBACK_PREFIX
from herald.storage.migrations import Migration, Schema, Session, load, load_functions
from herald.storage.postgres.db import NOW_SQL
from herald.storage.postgres.jobs import NUMBER_LOCK_SEED
from herald.storage.postgres.webhooks import DRAIN_LOCK_CLASS, KEY_LOCK_CLASS, ORDER_LOCK_CLASS, SHARE_LOCK_CLASS

# The constants the SQL files name in braces.
SQL_PARAMS = {"now": NOW_SQL, "key_lock": KEY_LOCK_CLASS, "order_lock": ORDER_LOCK_CLASS,
              "callback_prefix": CALLBACK_PREFIX, "number_lock": NUMBER_LOCK_SEED,
              "notify": NOTIFY, "quiet": QUIET, "share_lock": SHARE_LOCK_CLASS, "drain_lock": DRAIN_LOCK_CLASS}

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


# The checksums a Herald from before sql/functions/ recorded for the files that defined
# functions then (and now only point to functions/): the same tables, columns and drops.
EARLIER_CHECKSUMS = {
    2: ("cc226ff28c5a628b4bfe049007fc028e7f20313189eb8cbc604fbba283502e4c",),
    5: ("8d21295175e51d1cbbc018e4f81ef0f194a4cace55ee9041bb08656ef2bea995",),
    7: ("7d5e09bcd15cc353aca3661d918a1f9368046626ecbe597a6b2d169d3a9eb32f",),
    8: ("d3b9382f3f006b26ab25340b73e235f57bbb50d8ef74a3b79a9d040a99da9b30",),
    10: ("502681109507930d239399da0f58f075319f27101f04587d941d9fc39d4392df",),
    12: ("e7220612765fc13d11ac725c02846ed627c2000c64677a960629cd4c86bd563d",),
    13: ("6d1c70b2ae931540caa75c0a5901bad1447fabe7d67eddc4c26809872f132c1c",),
}

SCHEMA = Schema(load("herald.storage.postgres", SQL_PARAMS), adopt,
                functions=load_functions("herald.storage.postgres", SQL_PARAMS), earlier_checksums=EARLIER_CHECKSUMS)
