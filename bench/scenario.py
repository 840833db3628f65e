"""What every scenario gets (``Context``) and what it gives back (``Outcome``).

An outcome always has ``herald``, ``baseline`` and ``ratio`` (the JSON's contract, and
what the smoke test checks), plus ``rows`` for the table: one measured quantity each,
Herald's value, the baseline's from the same run, their ratio (herald / baseline) and
which direction is better. A baseline that cannot run here (wrk or nginx missing) is
``{"available": false, "reason": ...}`` and its ratios are ``null``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.config import Sizes
from bench.procs import Procs
from bench.stats import ratio

if TYPE_CHECKING:
    from bench.pg import BenchPostgres
    from bench.systems import Herald

STORES = ("sqlite", "postgres")


@dataclass
class Context:
    sizes: Sizes
    root: Path
    procs: Procs
    smoke: bool
    wrk: bool
    nchan_missing: str | None  # why nginx + nchan cannot run, or None
    herald_env: dict[str, str] = field(default_factory=dict)  # --set: settings for every Herald process
    store: str = "sqlite"  # the store of the Herald deployments this scenario starts: sqlite or postgres
    shape: str = "one"  # one: `herald up`'s processes by hand; cluster: `herald up --cluster` (e2e only)
    postgres: BenchPostgres | None = None  # the run's PostgreSQL server (--store postgres or both)
    peers: bool = False  # --peers: the e2e scenario also runs Celery + Redis and arq (bench/peers.py)
    workers: int = 2  # --workers: worker processes of the e2e scenario's one-machine shape
    rounds: int = 1  # --rounds: with --peers, interleaved pairs of Herald's burst and the peers'
    shared: dict[str, Any] = field(default_factory=dict)  # what one store's run of a scenario leaves for the next
    started: float = field(default_factory=time.monotonic)

    @property
    def variant(self) -> str:
        """What a result is labelled with: the store, or ``cluster`` for the cluster shape."""
        return "cluster" if self.shape == "cluster" else self.store

    def dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def store_meters(self) -> dict[str, Any]:
        """The PostgreSQL server (all its backends) for a ``CpuMeter``, when this run uses it."""
        from bench.procs import PidGroup

        server = self.postgres.server if self.postgres is not None and self.store == "postgres" else None
        if server is None or server.pid is None:
            return {}
        return {"postgres": PidGroup("postgres", [server.pid])}

    def herald(self, scenario: str, **settings: str) -> Herald:
        """A Herald deployment of this run's store under ``<scenario>/herald`` (SQLite) or
        ``<scenario>/herald-pg`` (PostgreSQL: a fresh database on the run's server)."""
        from bench.systems import Herald

        if self.store == "postgres":
            assert self.postgres is not None, "--store postgres needs the run's PostgreSQL server"
            url = self.postgres.database(scenario)
            return Herald(self.procs, self.dir(scenario) / "herald-pg", database_url=url,
                          **{**self.herald_env, **settings})
        return Herald(self.procs, self.dir(scenario) / "herald", **{**self.herald_env, **settings})

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass
class Row:
    case: str
    metric: str
    herald: float | None
    baseline: float | None
    better: str  # "higher" or "lower"
    unit: str = ""

    @property
    def ratio(self) -> float | None:
        return ratio(self.herald, self.baseline)

    def as_dict(self) -> dict[str, Any]:
        return {"case": self.case, "metric": self.metric, "unit": self.unit, "herald": self.herald,
                "baseline": self.baseline, "ratio": self.ratio, "better": self.better}


@dataclass
class Outcome:
    scenario: str
    title: str
    baseline_name: str
    herald: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unavailable: str | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    store: str = "sqlite"
    shape: str = "one"

    def row(self, case: str, metric: str, herald: float | None, baseline: float | None, *, better: str,
            unit: str = "") -> Row:
        row = Row(case, metric, herald, None if self.unavailable else baseline, better, unit)
        self.rows.append(row)
        return row

    def target(self, text: str, value: str, met: bool | None) -> None:
        """One of the issue's targets: ``met`` is None when it could not be judged (no baseline)."""
        self.targets.append({"target": text, "value": value, "met": met})

    def baseline_unavailable(self, reason: str) -> None:
        self.unavailable = reason

    def as_dict(self) -> dict[str, Any]:
        available = {"available": False, "reason": self.unavailable} if self.unavailable else {"available": True}
        baseline = {"name": self.baseline_name, **self.baseline, **available}
        return {
            "scenario": self.scenario,
            "variant": "cluster" if self.shape == "cluster" else self.store,
            "store": self.store,
            "shape": self.shape,
            "title": self.title,
            "herald": self.herald,
            "baseline": baseline,
            "ratio": {f"{r.case}: {r.metric}": r.ratio for r in self.rows if r.baseline is not None or self.unavailable},
            "rows": [r.as_dict() for r in self.rows],
            "targets": self.targets,
            "notes": self.notes,
            "error": self.error,
            "elapsed_s": round(self.elapsed_s, 1),
        }
