"""Scratch directories: one per process that writes results, removed by another once it is gone.

A handler writes its result into a scratch file (``ctx.output``), which the worker commits to
the result store when the run succeeds and removes when it does not. A worker killed mid-job
(``kill -9``, the OOM killer, a power cut) does neither, and its partial file (a half-written
export of a tenant's data, any size) stayed on disk: with the NATS result store, in a scratch
directory no other process ever cleaned (``herald up --cluster`` gives each worker its own
data dir); with the file store, beside the job's result until the job expired.

So each process writes its scratch files in a directory of its own,
``HERALD_DATA_DIR/scratch/<pid>-<random>/``, made on its first scratch file and held for the
process's life by an exclusive ``flock`` on its ``.owner`` file. The kernel releases that lock
however the process ends, and only then: ``remove_orphans`` (run by every worker when it
starts and every ``SWEEP_EVERY_S`` after, so by the restarted worker of ``herald up --cluster``,
which keeps its data dir, and by any sibling sharing one under ``herald up``) removes exactly
the directories whose lock it can take. A live process's directory is never touched, whatever
its pid says (a pid is reused; a lock is not), and two sweepers never remove one twice. A
directory is made under a ``.new-`` name and renamed once locked, so no sweeper sees it
unlocked; a ``.new-`` one left by a process that died in between is removed after
``STAGING_STALE_S``.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from herald.keyfiles import private_dir

log = logging.getLogger("herald.scratch")

OWNER_FILE = ".owner"
STAGING_PREFIX = ".new-"
STAGING_STALE_S = 60.0  # a directory is renamed microseconds after it is made
SWEEP_EVERY_S = 60.0


class ScratchDir:
    """This process's scratch directory under ``root``, made (and locked) when first asked for.
    ``close()`` removes it and lets go of it; safe to call twice."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._path: Path | None = None
        self._lock_fd: int | None = None

    @property
    def path(self) -> Path:
        # Made again if someone removed it (an operator clearing the data dir): a handler's
        # open() would fail otherwise.
        if self._path is None or not self._path.is_dir():
            self.close()
            self._path, self._lock_fd = _claim(self.root)
        return self._path

    @property
    def made(self) -> Path | None:
        """The directory if this process has made it (``path`` makes it)."""
        return self._path

    def close(self) -> None:
        path, fd = self._path, self._lock_fd
        self._path = self._lock_fd = None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)  # still locked: no sweeper is in it
        if fd is not None:
            os.close(fd)


def _claim(root: Path) -> tuple[Path, int]:
    # The tenants' results as they are written: the owner's only (0700), also when the
    # directory was there before (a handler writes with its umask, 0644).
    private_dir(root)
    name = f"{os.getpid()}-{secrets.token_hex(4)}"
    staging = root / f"{STAGING_PREFIX}{name}"
    staging.mkdir(mode=0o700)
    fd = os.open(staging / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # close-on-exec (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file this call made: nobody else holds it
        os.write(fd, f"{os.getpid()}\n".encode())
        final = root / name
        staging.rename(final)
    except BaseException:
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, fd


def remove_orphans(root: Path) -> list[Path]:
    """Remove the scratch directories under ``root`` whose owner process is gone; the removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue  # a file: an older Herald's flat scratch file (its job's retention removes it)
        path = Path(entry.path)
        if entry.name.startswith(STAGING_PREFIX):
            try:
                stale = time.time() - entry.stat(follow_symlinks=False).st_mtime > STAGING_STALE_S
            except FileNotFoundError:
                continue
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        try:
            fd = os.open(path / OWNER_FILE, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not a process's scratch dir, or one being removed
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive (this very process included)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


async def remove_orphans_every(root: Path, every_s: float = SWEEP_EVERY_S) -> None:
    """``remove_orphans`` now and then every ``every_s``, logging what it removed (a worker's task)."""
    while True:
        try:
            for path in await asyncio.to_thread(remove_orphans, root):
                log.info("removed the scratch directory of a process that is gone", extra={"directory": str(path)})
        except OSError as exc:  # the data dir unreadable for a moment: the next pass tries again
            log.warning("removing orphaned scratch directories failed: %s", exc)
        await asyncio.sleep(every_s)
