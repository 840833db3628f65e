from __future__ import annotations

import time
from datetime import datetime, timezone


# The latest time ``rfc3339`` can write (a year of four digits): a time a client sends to be
# stored and shown again (a key's expiry) must not be later, or showing it would fail.
LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc).timestamp()


def now() -> float:
    return time.time()


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
