"""Sealing the secrets of a PostgreSQL store in place: the plaintext rows an older Herald
wrote (at every start), or every row not sealed under the first key (``herald secrets
reencrypt``).

Any number of processes may do this at once: each row is replaced only if it still holds
the value that was read (compare-and-set), so a row is sealed once, never sealed twice.
``herald_secrets.value`` is TEXT (hex), the blob's hex form.
"""

from __future__ import annotations

import asyncpg

from herald.sealing import FINGERPRINT_BYTES, MAGIC, Sealer, key_aad, secret_aad, unknown_key_error


async def _has_webhook_keys(pool: asyncpg.Pool) -> bool:
    """A job store opened without the webhook tables (a tool, a test) has only its own secrets."""
    return bool(await pool.fetchval("SELECT to_regclass('webhook_keys') IS NOT NULL"))


def _needs(sealer: Sealer, blob: bytes, everything: bool) -> bool:
    return sealer.needs_reseal(blob) if everything else not sealer.is_sealed(blob)


async def reseal(pool: asyncpg.Pool, sealer: Sealer, *, everything: bool) -> int:
    """Seal what needs it under the first key; the number of rows changed."""
    prefix = sealer.current_prefix if everything else MAGIC
    changed = 0
    rows = await pool.fetch(
        "SELECT owner, created_at, algorithm, secret, public_key FROM webhook_keys"
        " WHERE substring(secret FROM 1 FOR $1) <> $2", len(prefix), prefix) if await _has_webhook_keys(pool) else []
    for row in rows:
        blob = bytes(row["secret"])
        if not _needs(sealer, blob, everything):
            continue
        public_key = bytes(row["public_key"]) if row["public_key"] is not None else None
        sealed = sealer.reseal(blob, key_aad(row["owner"], row["algorithm"], public_key))
        status = await pool.execute(
            "UPDATE webhook_keys SET secret = $1 WHERE owner = $2 AND created_at = $3 AND secret = $4",
            sealed, row["owner"], row["created_at"], blob)
        changed += status == "UPDATE 1"
    for row in await pool.fetch("SELECT name, value FROM herald_secrets"):
        blob = bytes.fromhex(row["value"])
        if not _needs(sealer, blob, everything):
            continue
        status = await pool.execute(
            "UPDATE herald_secrets SET value = $1 WHERE name = $2 AND value = $3",
            sealer.reseal(blob, secret_aad(row["name"])).hex(), row["name"], row["value"])
        changed += status == "UPDATE 1"
    return changed


async def check_keys(pool: asyncpg.Pool, sealer: Sealer) -> None:
    """Refuse a store whose secrets this process could not open (a wrong or missing key)."""
    n = len(MAGIC) + FINGERPRINT_BYTES
    heads = [bytes(r[0]) for r in await pool.fetch(f"SELECT DISTINCT substring(secret FROM 1 FOR {n}) FROM webhook_keys")
             ] if await _has_webhook_keys(pool) else []
    heads += [bytes.fromhex(r[0]) for r in await pool.fetch(f"SELECT DISTINCT left(value, {2 * n}) FROM herald_secrets")]
    if any(head.startswith(MAGIC) and not sealer.knows(head) for head in heads):
        raise unknown_key_error("the store")
