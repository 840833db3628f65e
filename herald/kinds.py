"""Job kinds as the API sees them: declarations, kept apart from the code that runs them.

A declaration (``KindDeclaration``) says everything a gateway needs — the name, the params
Struct (the request body), the collection path its jobs start at and whose ``/{id}``
serves the result, the media types it can produce, its deadline, attempts and default
concurrency, an example body — and names its handler by import path
(``"package.module:function"``). Only workers import handlers (``workers.registry``), so a
gateway never loads a handler's dependencies (fpdf2 for reports, say).

Kinds are found, at every process's start, in two places (``discover``):

* the ``herald.kinds`` entry-point group of every installed distribution — Herald's own
  ``report`` and ``export`` are registered there exactly like a user's kind::

      [project.entry-points."herald.kinds"]
      wordfreq = "wordfreq.kinds:WORDFREQ"

* ``HERALD_KINDS=module:attr,…`` for a module that is not installed as a package (looked up
  from the current directory too, as uvicorn and celery do).

An entry may name one declaration or a sequence of them. Two kinds claiming one name or
one path, an entry point that cannot be loaded or that names something else: the process
refuses to start and the message says which (``KindError``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import ExportParams, JobParams, ReportParams
from schemas.validation import InvalidBody, validate_params

ENTRY_POINT_GROUP = "herald.kinds"
JSON_MEDIA_TYPE = "application/json"

# A kind's name is a NATS subject token and part of a durable consumer's name.
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_COLLECTION = re.compile(r"^/[a-z0-9][a-z0-9_.-]{0,62}$")
# Paths Herald's own routes use: a kind may not take them.
RESERVED_COLLECTIONS = frozenset({"/jobs", "/events", "/webhooks", "/schema", "/metrics", "/healthz", "/readyz",
                                  "/static", "/problems"})
# What a result file is called after its media type, when the declaration does not say.
_SUFFIXES = {
    JSON_MEDIA_TYPE: ".json", "application/pdf": ".pdf", "text/csv": ".csv", "application/x-ndjson": ".ndjson",
    "text/plain": ".txt", "text/html": ".html", "image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp",
    "application/zip": ".zip", "application/octet-stream": ".bin",
}


class KindError(RuntimeError):
    """A kind cannot be loaded, is malformed, or clashes with another; the message names it."""


MediaType = str | Callable[[Any], str]


@dataclass(frozen=True, slots=True)
class KindDeclaration:
    """One job kind. Only ``name``, ``params``, ``collection`` and ``handler`` are required.

    * ``handler``: ``"package.module:function"``, an ``async def handler(ctx, params)``
      imported by workers only. It writes a file result to ``ctx.output`` and returns None,
      or returns a JSON-able value (stored as the ``application/json`` result).
    * ``media_type``: the file result's media type, a string or a function of the params
      (``export``: CSV or NDJSON). Default ``application/json``, for a kind whose handler
      returns its result.
    * ``suffix``: the result file's suffix (string or function of the params); default from
      the media type (``.pdf`` for ``application/pdf``, ...).
    * ``media_types``: every media type the kind can produce, for the API document;
      default: ``media_type`` when it is a string.
    * ``deadline_s`` / ``max_attempts``: default ``HERALD_JOB_DEADLINE_S`` /
      ``HERALD_MAX_ATTEMPTS``.
    * ``concurrency``: how many jobs of this kind one worker process runs at once (default:
      ``HERALD_WORKER_CONCURRENCY``, the process's total); ``HERALD_WORKER_KIND_CONCURRENCY``
      overrides it per worker.
    * ``example``: a valid request body, shown in the OpenAPI document (checked at start).
    * ``description``: one paragraph for the API document.
    """

    name: str
    params: type[JobParams]
    collection: str
    handler: str  # "package.module:function", imported by workers only
    media_type: MediaType = JSON_MEDIA_TYPE
    suffix: str | Callable[[Any], str] | None = None
    media_types: tuple[str, ...] = ()
    deadline_s: float | None = None  # None: HERALD_JOB_DEADLINE_S
    max_attempts: int | None = None  # None: HERALD_MAX_ATTEMPTS
    concurrency: int | None = None  # None: HERALD_WORKER_CONCURRENCY
    example: Mapping[str, Any] | None = field(default=None, hash=False)
    description: str = ""

    def __post_init__(self) -> None:
        where = f"job kind {self.name!r}"
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise KindError(f"{where}: the name must be lower-case letters, digits and _ (a letter first, at most 63)")
        if not isinstance(self.collection, str) or not _COLLECTION.match(self.collection):
            raise KindError(f"{where}: the collection must be one path segment like '/thumbnails', got {self.collection!r}")
        if self.collection in RESERVED_COLLECTIONS:
            raise KindError(f"{where}: the collection {self.collection!r} is one of Herald's own paths")
        if not (isinstance(self.params, type) and issubclass(self.params, JobParams)):
            raise KindError(f"{where}: params must be a subclass of schemas.JobParams, got {self.params!r}")
        module, sep, attribute = self.handler.partition(":") if isinstance(self.handler, str) else ("", "", "")
        if not sep or not module or not attribute:
            raise KindError(f"{where}: handler must be 'module:function', got {self.handler!r}")
        if not self.media_types and not isinstance(self.media_type, str):
            raise KindError(f"{where}: a media_type chosen by the params needs media_types listing every answer")
        for name in ("deadline_s", "max_attempts", "concurrency"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise KindError(f"{where}: {name} must be positive, got {value!r}")
        if self.example is not None:
            try:
                validate_params(self.params, dict(self.example))
            except InvalidBody as exc:
                raise KindError(f"{where}: the example body is not valid: {exc}") from None

    # ----- what the result is ----------------------------------------------------------

    def result_media_type(self, params: Any) -> str:
        """The media type of the file result of a job with these params."""
        return self.media_type if isinstance(self.media_type, str) else self.media_type(params)

    def result_suffix(self, params: Any) -> str:
        if isinstance(self.suffix, str):
            return self.suffix
        if self.suffix is not None:
            return self.suffix(params)
        return _SUFFIXES.get(self.result_media_type(params), ".bin")

    @property
    def all_media_types(self) -> tuple[str, ...]:
        """Every media type a result of this kind can have (a returned value is JSON)."""
        declared = self.media_types or ((self.media_type,) if isinstance(self.media_type, str) else ())
        return declared

    def attempts(self, default: int) -> int:
        return self.max_attempts or default


# ----- the built-in kinds (registered as entry points in Herald's own pyproject.toml) --------


def _export_media_type(params: ExportParams) -> str:
    return "text/csv" if params.format == "csv" else "application/x-ndjson"


REPORT = KindDeclaration(
    name="report",
    params=ReportParams,
    collection="/reports",
    handler="workers.kinds.report:run_report",
    media_type="application/pdf",
    # Rendering is CPU work in threads: more at once only slows each and the worker's loop
    # (its heartbeats; bench/RESULTS.md, "More jobs in flight per worker").
    concurrency=4,
    example={"title": "Quarterly report", "pages": 5},
    description="A PDF with one page per step; each page costs HERALD_REPORT_PAGE_MS (demo kind).",
)

EXPORT = KindDeclaration(
    name="export",
    params=ExportParams,
    collection="/exports",
    handler="workers.kinds.export:run_export",
    media_type=_export_media_type,
    media_types=("text/csv", "application/x-ndjson"),
    concurrency=4,  # rows made and written in threads: CPU work, as the report's
    example={"format": "csv", "rows": 1000},
    description="A deterministic synthetic orders table as CSV (with a header row) or NDJSON (demo kind).",
)


# ----- discovery ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Found:
    """A declaration and where it came from (for messages)."""

    kind: KindDeclaration
    origin: str


def _ensure_cwd_on_path() -> None:
    """Modules named by HERALD_KINDS (and their handlers) may live in the current directory."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _declarations(value: object, origin: str) -> list[Found]:
    if isinstance(value, KindDeclaration):
        return [Found(value, origin)]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        items = list(value)
        if items and all(isinstance(item, KindDeclaration) for item in items):
            return [Found(item, origin) for item in items]
    raise KindError(f"{origin} names {value!r}, not a herald.kinds.KindDeclaration (or a list of them)")


def _from_entry_points() -> list[Found]:
    found: list[Found] = []
    points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value))
    for point in points:
        dist = getattr(point, "dist", None)
        origin = f"entry point {point.name} = {point.value!r} (group {ENTRY_POINT_GROUP}"
        origin += f", distribution {dist.name} {dist.version})" if dist is not None else ")"
        try:
            value = point.load()
        except KindError as exc:
            raise KindError(f"{origin}: {exc}") from exc
        except Exception as exc:  # anything an import can raise
            raise KindError(f"{origin} cannot be loaded: {type(exc).__name__}: {exc}") from exc
        found += _declarations(value, origin)
    return found


def _from_paths(paths: Sequence[str]) -> list[Found]:
    found: list[Found] = []
    for path in paths:
        path = path.strip()
        if not path:
            continue
        origin = f"HERALD_KINDS item {path!r}"
        module_name, sep, attribute = path.partition(":")
        if not sep or not module_name or not attribute:
            raise KindError(f"{origin}: must be 'module:attribute'")
        _ensure_cwd_on_path()
        try:
            value: object = importlib.import_module(module_name)
            for part in attribute.split("."):
                value = getattr(value, part)
        except KindError as exc:
            raise KindError(f"{origin}: {exc}") from exc
        except Exception as exc:
            raise KindError(f"{origin} cannot be loaded: {type(exc).__name__}: {exc}") from exc
        found += _declarations(value, origin)
    return found


def index(found: Iterable[Found]) -> dict[str, Found]:
    """By name; refuses two kinds with one name or one path, naming both. The same
    declaration reached twice (an entry point and HERALD_KINDS) counts once."""
    by_name: dict[str, Found] = {}
    by_path: dict[str, Found] = {}
    for item in found:
        kind = item.kind
        other = by_name.get(kind.name) or by_path.get(kind.collection)
        if other is not None:
            if other.kind == kind:
                continue
            claim = f"the name {kind.name!r}" if other.kind.name == kind.name else f"the path {kind.collection!r}"
            raise KindError(
                f"two job kinds claim {claim}: {other.kind.name!r} at {other.kind.collection} from {other.origin}, "
                f"and {kind.name!r} at {kind.collection} from {item.origin}; remove or rename one"
            )
        by_name[kind.name] = item
        by_path[kind.collection] = item
    return by_name


def discover(paths: Sequence[str] = ()) -> dict[str, Found]:
    """Every kind: the ``herald.kinds`` entry points, then ``paths`` (HERALD_KINDS)."""
    kinds = index([*_from_entry_points(), *_from_paths(paths)])
    if not kinds:
        raise KindError(
            f"no job kinds found: not even Herald's own (entry-point group {ENTRY_POINT_GROUP}). "
            "Is Herald installed (pip install -e .)? Its metadata may predate the entry points: reinstall it."
        )
    return kinds


_FOUND: dict[str, Found] | None = None


def load_kinds(paths: Sequence[str] = ()) -> dict[str, KindDeclaration]:
    """Discover the kinds now (at a process's start: errors surface here) and keep them
    as this process's kinds; ``paths`` is HERALD_KINDS (``Settings.kinds``)."""
    global _FOUND
    _FOUND = discover(paths)
    return declared_kinds()


def _found() -> dict[str, Found]:
    if _FOUND is None:
        load_kinds()  # a process that did not load them at start (a test's app): entry points only
    assert _FOUND is not None
    return _FOUND


def declared_kinds() -> dict[str, KindDeclaration]:
    return {name: item.kind for name, item in _found().items()}


def kind_origins() -> dict[str, str]:
    """Where each kind was declared (``herald kinds`` shows it)."""
    return {name: item.origin for name, item in _found().items()}


def get_kind(name: str) -> KindDeclaration | None:
    item = _found().get(name)
    return item.kind if item is not None else None
