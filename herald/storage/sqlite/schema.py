"""The SQLite schema: ``sql/NNNN_*.sql`` beside this module, applied by ``herald.storage.migrations``.

Before the runner, every open ran the whole schema script (``CREATE ... IF NOT EXISTS``
throughout) and then added the columns an older data dir lacked. Such a data dir (a
``jobs`` table, no record) is adopted by doing that once more -- the files it stands for
are that script, unchanged -- and recording them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from herald.storage.migrations import Migration, Schema, Session, load

# The versions the pre-runner script consisted of.
_ADOPTED = (1, 2, 3)
# The columns added after the first data dirs were made (trace contexts, outbox origins,
# results in the row).
_LATER_COLUMNS = {
    "jobs": (("traceparent", "TEXT"), ("tracestate", "TEXT"), ("result_body", "BLOB")),
    "outbox": (("traceparent", "TEXT"), ("tracestate", "TEXT"), ("origin", "TEXT")),
}


async def adopt(session: Session, migrations: Sequence[Migration]) -> Collection[int]:
    """A data dir from before the runner brought to what its every open made it; its versions."""
    if not await session.fetch("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'jobs'"):
        return ()
    for version in _ADOPTED:
        await session.execute(migrations[version - 1].sql)
    for table, added in _LATER_COLUMNS.items():
        columns = {row[1] for row in await session.fetch(f"PRAGMA table_info({table})")}
        for column, type_ in added:
            if column not in columns:
                await session.execute(f"ALTER TABLE {table} ADD COLUMN {column} {type_}")
    return _ADOPTED


SCHEMA = Schema(load("herald.storage.sqlite"), adopt)
