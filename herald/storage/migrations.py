"""The schema as numbered SQL files, and the one runner that applies them to either store.

Each backend keeps its schema in ``herald/storage/<backend>/sql/NNNN_name.sql`` (package
data, read with ``importlib.resources``): one sequence per backend, numbered from 1 without
gaps. A database records what it has in ``herald_schema_migrations`` (version, name, the
SHA-256 of the SQL as applied, when); opening a store applies the files it lacks, in order,
and records each in the same transaction as its SQL.

Concurrency is the backend's: it runs ``migrate`` inside one transaction that holds its
schema lock (PostgreSQL: an advisory transaction lock; SQLite: the write lock, ``BEGIN
IMMEDIATE``), so of several processes starting at once one migrates and the others, once
they get the lock, find every version recorded.

A database made before this runner (no record yet, but the tables there) is *adopted*: the
backend's ``adopt`` tells which versions it already has, and those are recorded without
running them again.

A file may name constants that Python owns (a lock class, the clock expression) in braces,
``{now}``; they are filled in from the backend's parameters when the file is read. Only
names the backend defines are replaced, and a name it does not define is an error, so a
typo fails when the file is read rather than when its SQL runs. Any other brace (an array
literal such as ``'{}'``) is left alone: no escaping.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

log = logging.getLogger("herald.migrations")

# Plain enough for both dialects (SQLite reads DOUBLE PRECISION as REAL).
TABLE = "herald_schema_migrations"
CREATE_TABLE = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
    " checksum TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
)

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str
    checksum: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checksum", hashlib.sha256(self.sql.encode()).hexdigest())


class Session(Protocol):
    """One backend's connection, inside the transaction that holds its schema lock."""

    async def execute(self, sql: str) -> None:
        """Run ``sql`` (one or several statements, no parameters)."""

    async def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of one query without parameters."""

    async def record(self, migration: Migration) -> None:
        """Insert ``migration``'s row into ``herald_schema_migrations``, stamped with the backend's clock."""


# Which of the given migrations a database made before the runner already has (and what,
# if anything, it must do to vouch for them); an empty collection for a new database.
Adopt = Callable[[Session, Sequence[Migration]], Awaitable[Collection[int]]]


@dataclass(frozen=True)
class Schema:
    migrations: tuple[Migration, ...]
    adopt: Adopt | None = None


def render(text: str, params: Mapping[str, object], *, source: str = "SQL") -> str:
    """``text`` with its ``{name}`` placeholders filled in from ``params``."""

    def fill(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in params:
            raise KeyError(f"{source} names {{{key}}}, which its backend does not define")
        return str(params[key])

    return _PLACEHOLDER.sub(fill, text)


def load(package: str, params: Mapping[str, object] | None = None) -> tuple[Migration, ...]:
    """Every ``sql/NNNN_name.sql`` of ``package``, in order, its placeholders filled in.

    Raises ``ValueError`` for a file named otherwise, or versions that are not 1, 2, 3, ...
    (a gap or a duplicate is a mistake: a database would skip or mix them up)."""
    found: list[Migration] = []
    for entry in (resources.files(package) / "sql").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _FILE.match(entry.name)
        if match is None:
            raise ValueError(f"{package}: sql/{entry.name} is not named NNNN_name.sql")
        text = render(entry.read_text(encoding="utf-8"), params or {}, source=f"{package}: sql/{entry.name}")
        found.append(Migration(int(match.group(1)), match.group(2), text))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise ValueError(f"{package}: the sql/ files are numbered {versions}, not 1, 2, 3, ... without gaps")
    return tuple(found)


async def migrate(session: Session, schema: Schema) -> list[Migration]:
    """Bring the database to ``schema``; returns the migrations applied now (none: it was up to date).

    The caller holds the schema lock and commits afterwards."""
    await session.execute(CREATE_TABLE)
    applied = await _applied(session)
    if not applied and schema.adopt is not None:
        for version in sorted(await schema.adopt(session, schema.migrations)):
            migration = schema.migrations[version - 1]
            await session.record(migration)
            log.info("schema migration recorded: the database, made before the migration runner, has it",
                     extra={"migration": version, "migration_name": migration.name})
        applied = await _applied(session)
    known = {m.version for m in schema.migrations}
    unknown = sorted(set(applied) - known)
    if unknown:
        log.warning("the database has schema migrations %s this Herald does not know: a newer Herald migrated it",
                    unknown)
    done: list[Migration] = []
    for migration in schema.migrations:
        checksum = applied.get(migration.version)
        if checksum is None:
            await session.execute(migration.sql)
            await session.record(migration)
            log.info("schema migration applied", extra={"migration": migration.version,
                                                        "migration_name": migration.name})
            done.append(migration)
        elif checksum != migration.checksum:
            # Editing a migration once released changes nothing in the databases that ran it:
            # the change belongs in a new file. Said loudly, not fatal (whitespace counts too).
            log.warning("schema migration %04d_%s differs from the one this database applied; a change to an"
                        " applied migration belongs in a new one", migration.version, migration.name)
    return done


async def _applied(session: Session) -> dict[int, str]:
    return {int(version): str(checksum)
            for version, checksum in await session.fetch(f"SELECT version, checksum FROM {TABLE}")}
