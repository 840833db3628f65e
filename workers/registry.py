"""The worker's side of job kinds: the kinds this worker serves, each with its handler imported.

Handlers are imported here, at worker start, so a handler that cannot be imported (or is
not an ``async def``) stops the worker with its name instead of failing the first job.
A worker serves every declared kind, or only those of ``HERALD_WORKER_KINDS`` /
``herald worker --kinds a,b``; naming a kind nobody declared is an error at start too.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from herald.kinds import KindDeclaration, KindError, declared_kinds, kind_origins
from herald.settings import Settings

if TYPE_CHECKING:
    from workers.context import JobContext

# ``async def handler(ctx, params) -> None | <JSON-able value>``
Handler = Callable[["JobContext", Any], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class JobKind:
    declaration: KindDeclaration
    handler: Handler
    concurrency: int  # jobs of this kind one worker process runs at once

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def params(self) -> type[Any]:
        return self.declaration.params

    def media_type(self, params: Any) -> str:
        return self.declaration.result_media_type(params)

    def suffix(self, params: Any) -> str:
        return self.declaration.result_suffix(params)


def load_handler(declaration: KindDeclaration, origin: str = "") -> Handler:
    module_name, _, attribute = declaration.handler.partition(":")
    where = f"job kind {declaration.name!r}" + (f" ({origin})" if origin else "")
    try:
        handler: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            handler = getattr(handler, part)
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raised on import
        raise KindError(
            f"{where}: cannot import handler {declaration.handler!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not inspect.iscoroutinefunction(handler):
        raise KindError(f"{where}: handler {declaration.handler!r} must be an 'async def handler(ctx, params)'")
    return handler  # type: ignore[no-any-return]


def served_names(settings: Settings, declared: Mapping[str, KindDeclaration]) -> list[str]:
    """The kinds this worker serves (HERALD_WORKER_KINDS, else all), checked against ``declared``."""
    names = list(dict.fromkeys(settings.worker_kinds)) or sorted(declared)
    unknown = [name for name in names if name not in declared]
    if unknown:
        raise KindError(
            f"HERALD_WORKER_KINDS / --kinds names {', '.join(map(repr, unknown))}, which no installed package "
            f"declares; declared kinds: {', '.join(sorted(declared)) or 'none'}"
        )
    stray = [name for name in settings.worker_kind_concurrency if name not in declared]
    if stray:
        raise KindError(
            f"HERALD_WORKER_KIND_CONCURRENCY names {', '.join(map(repr, stray))}, which no installed package "
            f"declares; declared kinds: {', '.join(sorted(declared))}"
        )
    return names


def concurrency_of(declaration: KindDeclaration, settings: Settings) -> int:
    """Per worker process: HERALD_WORKER_KIND_CONCURRENCY, else the declaration's, else the
    process's total (HERALD_WORKER_CONCURRENCY), and never more than that total."""
    wanted = settings.worker_kind_concurrency.get(declaration.name) or declaration.concurrency
    return max(1, min(wanted or settings.worker_concurrency, settings.worker_concurrency))


def load(settings: Settings) -> dict[str, JobKind]:
    """The kinds this worker serves, every handler imported now (errors name the kind)."""
    declared = declared_kinds()
    origins = kind_origins()
    return {
        name: JobKind(
            declaration=declared[name],
            handler=load_handler(declared[name], origins.get(name, "")),
            concurrency=concurrency_of(declared[name], settings),
        )
        for name in served_names(settings, declared)
    }
