"""Keys that ``herald up`` generates once and keeps under ``HERALD_DATA_DIR``, mode 0600."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from herald.settings import SettingsError


def load_or_create(path: Path, *, nbytes: int = 32) -> str:
    """The key in ``path``, generated (urlsafe, ``nbytes`` random bytes) if there is none.

    Created with O_EXCL and mode 0600: never readable by others, not even for a moment, and
    two processes starting at once agree on one key (the loser reads the winner's). One found
    that others may read or write (copied in, restored from a backup, chmod-ed by hand) is
    refused with a ``SettingsError`` naming it, as ``secret.key`` is (``herald.sealing``): its
    key may already be known, and serving with it would hide that."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SettingsError(f"{path} holds a key and others may read or change it: chmod 600 it "
                                "(or remove it, and a new key is made)") from None
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


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can list or write (0700), made with its parents
    if missing. An existing one is tightened too: what Herald keeps there (the store, results,
    keys) is nobody else's to read. A search-only bit (x without r or w) is left as it is:
    the launcher grants it on purpose (launcher/pgserver.py) so that PostgreSQL, started as
    another user when Herald runs as root, can reach its data dir below by name. Removing it
    while the server runs made its shutdown checkpoint fail (a PANIC, then crash recovery)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o066:
        path.chmod(0o700)
    return path


def write_private(path: Path, text: str) -> Path:
    """Replace ``path`` with ``text``, readable by its owner only (0600) from its first byte."""
    private_dir(path.parent)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(staging, path)
    return path


def private_file(path: Path) -> None:
    """Create ``path`` empty if missing (0600) and make sure it is 0600: for files another
    library creates and fills (SQLite's, which gives its -wal and -shm the same mode)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
