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

Functions are not history: each lives once, in its current form, in
``sql/functions/name.sql`` (a *repeatable* definition, as Flyway calls them), written with
``CREATE OR REPLACE``. After the numbered files, in the same transaction, the runner applies
every such file whose SHA-256 differs from the one ``herald_schema_functions`` records for
its name (or that it does not record yet), and records it: a changed function is replaced
once, an unchanged one is left alone. What ``CREATE OR REPLACE`` cannot do -- drop a
function that is gone, or the old one of a changed signature or return type -- is history,
and belongs in a numbered file.

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
FUNCTIONS_TABLE = "herald_schema_functions"
CREATE_FUNCTIONS_TABLE = (
    f"CREATE TABLE IF NOT EXISTS {FUNCTIONS_TABLE} (name TEXT PRIMARY KEY, checksum TEXT NOT NULL,"
    " applied_at DOUBLE PRECISION NOT NULL)"
)

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_FUNCTION_FILE = re.compile(r"^([a-z0-9_]+)\.sql$")
# A repeatable file is applied again and again: a plain CREATE FUNCTION fails the second time.
_PLAIN_CREATE = re.compile(r"\bCREATE\s+FUNCTION\b", re.IGNORECASE)
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str
    checksum: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checksum", hashlib.sha256(self.sql.encode()).hexdigest())


@dataclass(frozen=True)
class Function:
    """A repeatable definition: ``sql/functions/<name>.sql``, one or several functions."""

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

    async def record_function(self, function: Function) -> None:
        """Insert or replace ``function``'s row in ``herald_schema_functions``, stamped with the backend's clock."""


# Which of the given migrations a database made before the runner already has (and what,
# if anything, it must do to vouch for them); an empty collection for a new database.
Adopt = Callable[[Session, Sequence[Migration]], Awaitable[Collection[int]]]


@dataclass(frozen=True)
class Schema:
    migrations: tuple[Migration, ...]
    adopt: Adopt | None = None
    functions: tuple[Function, ...] = ()
    # version -> checksums an earlier Herald recorded for it, whose SQL did the same to the
    # database as the file does now (the functions it defined moved to sql/functions/).
    earlier_checksums: Mapping[int, Collection[str]] = field(default_factory=dict)


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


def load_functions(package: str, params: Mapping[str, object] | None = None) -> tuple[Function, ...]:
    """Every ``sql/functions/name.sql`` of ``package``, by name, its placeholders filled in.

    Raises ``ValueError`` for a file named otherwise or one with a plain ``CREATE FUNCTION``."""
    folder = resources.files(package) / "sql" / "functions"
    if not folder.is_dir():
        return ()
    found: list[Function] = []
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _FUNCTION_FILE.match(entry.name)
        if match is None:
            raise ValueError(f"{package}: sql/functions/{entry.name} is not named name.sql")
        source = f"{package}: sql/functions/{entry.name}"
        text = render(entry.read_text(encoding="utf-8"), params or {}, source=source)
        if _PLAIN_CREATE.search(text):
            raise ValueError(f"{source} has a CREATE FUNCTION; a repeatable file says CREATE OR REPLACE")
        found.append(Function(match.group(1), text))
    return tuple(sorted(found, key=lambda f: f.name))


async def migrate(session: Session, schema: Schema) -> list[Migration | Function]:
    """Bring the database to ``schema``; returns the migrations, then the functions, applied
    now (none: it was up to date).

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
    done: list[Migration | Function] = []
    for migration in schema.migrations:
        checksum = applied.get(migration.version)
        if checksum is None:
            if _has_statement(migration.sql):  # a file of comments only (asyncpg fails on an empty query)
                await session.execute(migration.sql)
            await session.record(migration)
            log.info("schema migration applied", extra={"migration": migration.version,
                                                        "migration_name": migration.name})
            done.append(migration)
        elif checksum != migration.checksum and checksum not in schema.earlier_checksums.get(migration.version, ()):
            # Editing a migration once released changes nothing in the databases that ran it:
            # the change belongs in a new file. Said loudly, not fatal (whitespace counts too).
            log.warning("schema migration %04d_%s differs from the one this database applied; a change to an"
                        " applied migration belongs in a new one", migration.version, migration.name)
    if schema.functions:
        done.extend(await _apply_functions(session, schema.functions))
    return done


async def _apply_functions(session: Session, functions: Sequence[Function]) -> list[Function]:
    """The repeatable files whose recorded checksum differs (or is missing), applied and recorded."""
    await session.execute(CREATE_FUNCTIONS_TABLE)
    recorded = {str(name): str(checksum)
                for name, checksum in await session.fetch(f"SELECT name, checksum FROM {FUNCTIONS_TABLE}")}
    # A file that went: forget its record, so that one of that name added again is applied.
    for gone in sorted(set(recorded) - {f.name for f in functions}):
        await session.execute(f"DELETE FROM {FUNCTIONS_TABLE} WHERE name = '{gone}'")
    done: list[Function] = []
    for function in functions:
        if recorded.get(function.name) == function.checksum:
            continue
        await session.execute(function.sql)
        await session.record_function(function)
        log.info("schema functions applied", extra={"functions": function.name})
        done.append(function)
    return done


def _has_statement(sql: str) -> bool:
    return any(line.strip() and not line.lstrip().startswith("--") for line in sql.splitlines())


async def _applied(session: Session) -> dict[int, str]:
    return {int(version): str(checksum)
            for version, checksum in await session.fetch(f"SELECT version, checksum FROM {TABLE}")}
