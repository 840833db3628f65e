"""The worker's side of job kinds: each declaration (``herald.kinds``) with its handler imported.

Handlers are imported here, at worker start, so a handler that cannot be imported stops
the worker with its name instead of failing the first job.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from herald.kinds import KindDeclaration, declared_kinds

if TYPE_CHECKING:
    from workers.context import JobContext

Handler = Callable[["JobContext", Any], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class JobKind:
    declaration: KindDeclaration
    handler: Handler

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def params(self) -> type[Any]:
        return self.declaration.params

    def media_type(self, params: Any) -> str:
        return self.declaration.media_type(params)

    def suffix(self, params: Any) -> str:
        return self.declaration.suffix(params)


def load_handler(declaration: KindDeclaration) -> Handler:
    module_name, _, attribute = declaration.handler.partition(":")
    try:
        handler = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"job kind {declaration.name!r}: cannot import handler {declaration.handler!r}: {exc}") from exc
    if not callable(handler):
        raise RuntimeError(f"job kind {declaration.name!r}: handler {declaration.handler!r} is not callable")
    return handler  # type: ignore[no-any-return]


_LOADED: dict[str, JobKind] = {}


def kinds() -> dict[str, JobKind]:
    """Every declared kind with its handler, imported on first use."""
    if not _LOADED:
        for name, declaration in declared_kinds().items():
            _LOADED[name] = JobKind(declaration=declaration, handler=load_handler(declaration))
    return _LOADED


def get(name: str) -> JobKind | None:
    return kinds().get(name)
