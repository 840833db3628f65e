"""Job kinds as the API sees them: declarations, kept apart from the code that runs them.

A declaration says everything a gateway needs — the name, the params Struct (the request
body), the collection path its jobs start at and whose ``/{id}`` serves the result, the
media types it can produce, its deadline — and names its handler by import path
(``"package.module:function"``). Only workers import handlers (``workers.registry``), so a
gateway never loads a handler's dependencies (fpdf2 for reports, say).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas import ExportParams, JobParams, ReportParams


@dataclass(frozen=True, slots=True)
class KindDeclaration:
    name: str
    params: type[JobParams]
    collection: str
    handler: str  # "package.module:function", imported by workers only
    media_type: Callable[[Any], str]  # the result's media type, from the params
    suffix: Callable[[Any], str]  # the result file's suffix, from the params
    media_types: tuple[str, ...]  # every media_type() can answer (for the API reference)
    deadline_s: float | None = None  # None: HERALD_JOB_DEADLINE_S

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.collection.startswith("/") or self.collection.count("/") != 1:
            raise ValueError(f"bad job kind {self.name!r} at {self.collection!r}")
        if ":" not in self.handler:
            raise ValueError(f"job kind {self.name!r}: handler must be 'module:function', got {self.handler!r}")


def _export_media_type(params: ExportParams) -> str:
    return "text/csv" if params.format == "csv" else "application/x-ndjson"


def _export_suffix(params: ExportParams) -> str:
    return ".csv" if params.format == "csv" else ".ndjson"


BUILTIN_KINDS: tuple[KindDeclaration, ...] = (
    KindDeclaration(
        name="report",
        params=ReportParams,
        collection="/reports",
        handler="workers.kinds.report:run_report",
        media_type=lambda _params: "application/pdf",
        suffix=lambda _params: ".pdf",
        media_types=("application/pdf",),
    ),
    KindDeclaration(
        name="export",
        params=ExportParams,
        collection="/exports",
        handler="workers.kinds.export:run_export",
        media_type=_export_media_type,
        suffix=_export_suffix,
        media_types=("text/csv", "application/x-ndjson"),
    ),
)


def _index(declarations: tuple[KindDeclaration, ...]) -> dict[str, KindDeclaration]:
    by_name: dict[str, KindDeclaration] = {}
    by_path: dict[str, str] = {}
    for kind in declarations:
        if kind.name in by_name or kind.collection in by_path:
            raise ValueError(f"job kind {kind.name!r} or path {kind.collection!r} is declared twice")
        by_name[kind.name] = kind
        by_path[kind.collection] = kind.name
    return by_name


_KINDS = _index(BUILTIN_KINDS)


def declared_kinds() -> dict[str, KindDeclaration]:
    return _KINDS


def get_kind(name: str) -> KindDeclaration | None:
    return _KINDS.get(name)
