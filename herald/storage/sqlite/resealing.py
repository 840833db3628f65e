"""Sealing the secrets of a SQLite store in place: the plaintext rows an older Herald wrote
(at every start), or every row not sealed under the first key (``herald secrets reencrypt``).

Each pass is one write transaction, and each row is checked again inside it, so processes
starting at once agree: the first seals, the others find nothing left to do.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from herald.sealing import FINGERPRINT_BYTES, MAGIC, Sealer, key_aad, secret_aad, unknown_key_error
from herald.storage.sqlite.db import Database


def _has_webhook_keys(db: Database) -> bool:
    """A job store opened without the webhook tables (a tool, a test) has only its own secrets."""
    return bool(db.read("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'webhook_keys'"))


def _needs(sealer: Sealer, blob: bytes, everything: bool) -> bool:
    return sealer.needs_reseal(blob) if everything else not sealer.is_sealed(blob)


async def reseal(db: Database, sealer: Sealer, *, everything: bool) -> int:
    """Seal what needs it under the first key; the number of rows changed."""
    # A cheap pre-filter on the blob's head (SQL); the exact check is in Python.
    prefix = sealer.current_prefix if everything else MAGIC
    keys_sql = ("SELECT owner, created_at, algorithm, secret, public_key FROM webhook_keys"
                f" WHERE substr(secret, 1, {len(prefix)}) IS NOT ?")
    secrets_sql = f"SELECT name, value FROM herald_secrets WHERE substr(value, 1, {len(prefix)}) IS NOT ?"
    webhooks = _has_webhook_keys(db)
    if not (webhooks and db.read(keys_sql, (prefix,))) and not db.read(secrets_sql, (prefix,)):
        return 0  # the usual start: nothing to write, no write lock taken

    def tx(conn: sqlite3.Connection) -> int:
        # The plaintext cells an UPDATE replaces are zeroed in the file, not left in free space.
        conn.execute("PRAGMA secure_delete = ON")
        try:
            return _reseal_rows(conn)
        finally:
            conn.execute("PRAGMA secure_delete = OFF")

    def _reseal_rows(conn: sqlite3.Connection) -> int:
        changed = 0
        for row in conn.execute(keys_sql, (prefix,)).fetchall() if webhooks else ():
            blob = bytes(row["secret"])
            if not _needs(sealer, blob, everything):
                continue
            public_key = bytes(row["public_key"]) if row["public_key"] is not None else None
            sealed = sealer.reseal(blob, key_aad(row["owner"], row["algorithm"], public_key))
            conn.execute("UPDATE webhook_keys SET secret = ? WHERE owner = ? AND created_at = ?",
                         (sealed, row["owner"], row["created_at"]))
            changed += 1
        for row in conn.execute(secrets_sql, (prefix,)).fetchall():
            blob = bytes(row["value"])
            if _needs(sealer, blob, everything):
                conn.execute("UPDATE herald_secrets SET value = ? WHERE name = ?",
                             (sealer.reseal(blob, secret_aad(row["name"])), row["name"]))
                changed += 1
        return changed

    return await db.write(tx)


_HEAD = len(MAGIC) + FINGERPRINT_BYTES  # what names a blob's key
_SEALED_HEADS = {"webhook_keys": f"SELECT DISTINCT substr(secret, 1, {_HEAD}) FROM webhook_keys",
                 "herald_secrets": f"SELECT DISTINCT substr(value, 1, {_HEAD}) FROM herald_secrets"}


def _refuse_unknown_keys(read: Callable[[str], Sequence[Sequence[Any]]], sealer: Sealer) -> None:
    tables = {row[0] for row in read("SELECT name FROM sqlite_master WHERE type = 'table'")}
    heads = [bytes(row[0]) for table, sql in _SEALED_HEADS.items() if table in tables for row in read(sql)]
    if any(head.startswith(MAGIC) and not sealer.knows(head) for head in heads):
        raise unknown_key_error("the store")


def check_keys(db: Database, sealer: Sealer) -> None:
    """Refuse a store whose secrets this process could not open (a wrong or missing key)."""
    _refuse_unknown_keys(db.read, sealer)


def check_file_keys(path: Path, sealer: Sealer) -> None:
    """``check_keys`` on the database file, read-only, before any process opens it: a key set
    after the store was first sealed (``HERALD_SECRET_KEY`` after ``herald up`` made its key
    file) is said once, at start, not as every process's traceback. A file that is not there
    yet, or cannot be read, is left to the store's own opening."""
    if not path.exists():
        return
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return
    try:
        _refuse_unknown_keys(lambda sql: conn.execute(sql).fetchall(), sealer)
    except sqlite3.Error:
        return
    finally:
        conn.close()
