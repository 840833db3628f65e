"""The result store: files under the data dir, written whole before a job succeeds.

Kept behind this small interface so an object store (e.g. NATS object store) can
replace it when workers run on other machines.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class FileResultStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _job_dir(self, job_id: str) -> Path:
        return self.root / job_id[:2] / job_id

    def partial_path(self, job_id: str, attempt: int, suffix: str) -> Path:
        """Where an attempt writes while it runs. Never visible as a result."""
        directory = self._job_dir(job_id)
        directory.mkdir(parents=True, exist_ok=True)
        return directory / f"{attempt}{suffix}.part"

    def commit(self, partial: Path) -> str:
        """Make a finished file durable and final; returns the key stored on the job."""
        with open(partial, "rb") as fh:
            os.fsync(fh.fileno())
        final = partial.with_name(partial.name.removesuffix(".part"))
        os.replace(partial, final)
        return str(final.relative_to(self.root))

    def path(self, key: str) -> Path:
        return self.root / key

    def discard(self, key_or_path: str | Path) -> None:
        path = Path(key_or_path)
        if not path.is_absolute():
            path = self.root / path
        path.unlink(missing_ok=True)

    def delete_job(self, job_id: str) -> None:
        shutil.rmtree(self._job_dir(job_id), ignore_errors=True)
