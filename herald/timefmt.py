from __future__ import annotations

import time
from datetime import datetime, timezone


def now() -> float:
    return time.time()


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
