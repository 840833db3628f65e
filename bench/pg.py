"""The PostgreSQL server of a ``--store postgres`` run: one ``herald.pgserver.PostgresServer``
in the run's temp dir, on a free port, started on first use and stopped when the run ends.

Every Herald deployment of the run gets a database of its own (``database()``), so no
scenario sees another's rows, as every SQLite deployment has a file of its own. The server
runs with ``PostgresServer``'s settings, the ones ``herald up --cluster`` runs with (fsync
and synchronous commit on), plus ``--pg-set`` what-ifs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from bench.procs import free_port
from herald.pgserver import PostgresServer


class BenchPostgres:
    def __init__(self, data_dir: Path, settings: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.settings = dict(settings or {})
        self.server: PostgresServer | None = None
        self.created: list[str] = []
        self.start_s = 0.0

    def _started(self) -> PostgresServer:
        if self.server is None or not self.server.running:
            started = time.monotonic()
            self.server = PostgresServer(self.data_dir, port=free_port(), settings=self.settings)
            self.server.start()
            self.start_s = round(time.monotonic() - started, 1)
        return self.server

    def database(self, label: str) -> str:
        """A fresh, empty database for one deployment; returns its URL."""
        server = self._started()
        base = re.sub(r"[^a-z0-9_]", "_", label.lower())[:40] or "herald"
        name = f"{base}_{len(self.created) + 1}"
        self.created.append(name)
        return server.create_database(name)

    @property
    def version(self) -> str:
        server = self._started()
        return server.psql("SHOW server_version").strip()

    def describe(self) -> dict[str, object]:
        if self.server is None:
            return {}
        return {"version": self.version, "port": self.server.port, "settings": self.server.settings,
                "databases": len(self.created), "start_s": self.start_s}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
