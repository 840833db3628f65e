"""Ids of the rows Herald writes most: jobs and webhook deliveries.

UUIDv7 (RFC 9562): 48 bits of Unix milliseconds first, then 74 random bits (``rand_a`` and
``rand_b`` both random; SPEC §2: a job id is a random UUID, v4 or v7 with at least 74 random
bits, never sequential). Knowing one id tells nothing of another's random bits, so an id is
as hard to guess as before, but ids made close in time sort close together. Every index
keyed by them (a job's row, its events and messages, a delivery and its attempts) then
takes new entries at its right-hand edge: a transaction writes one leaf page per index for
a whole batch, where v4 ids wrote one page per row, scattered over the index, each a page
to write to the WAL at commit and, once the index outgrows the cache, a page to read first
(bench/RESULTS.md, issue 24). Python 3.11's ``uuid`` has no ``uuid7``; 3.14's gives 42 of
the bits to a counter and PostgreSQL 18's ``uuidv7()`` 12 to a finer timestamp, each leaving
fewer than 74 random.
"""

from __future__ import annotations

import os
import time
import uuid

_VERSION_7 = 0x7 << 76
_VARIANT_RFC = 0b10 << 62
_RAND_A_MASK = 0xFFF << 64
_RAND_B_MASK = (1 << 62) - 1


def uuid7(at_ms: int | None = None) -> uuid.UUID:
    """A UUIDv7: ``at_ms`` (now, by default) and 74 random bits from the OS's CSPRNG."""
    ms = time.time_ns() // 1_000_000 if at_ms is None else at_ms
    random = int.from_bytes(os.urandom(10), "big")  # 80 bits, 74 of them kept
    rand_a = (random >> 62) << 64 & _RAND_A_MASK
    return uuid.UUID(int=(ms & 0xFFFF_FFFF_FFFF) << 80 | _VERSION_7 | rand_a | _VARIANT_RFC | random & _RAND_B_MASK)


def new_id() -> str:
    """A new job or delivery id, as stored and shown: the canonical text of a UUIDv7."""
    return str(uuid7())
