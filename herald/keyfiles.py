"""Keys that ``herald up`` generates once and keeps under ``HERALD_DATA_DIR``, mode 0600."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def load_or_create(path: Path, *, nbytes: int = 32) -> str:
    """The key in ``path``, generated (urlsafe, ``nbytes`` random bytes) if there is none.

    Created with O_EXCL and mode 0600: never readable by others, not even for a moment, and
    two processes starting at once agree on one key (the loser reads the winner's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(100):  # the winner may not have written it yet
            key = path.read_text().strip()
            if key:
                return key
            os.sched_yield()
        raise RuntimeError(f"{path} is empty: remove it and start again") from None
    key = secrets.token_urlsafe(nbytes)
    with os.fdopen(fd, "w") as handle:
        handle.write(key + "\n")
    return key
