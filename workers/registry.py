"""Job kinds, registered in one place.

A kind is a name, a msgspec params Struct (the request body), the collection path its
jobs start at and whose ``/{id}`` serves the result, a media type and a handler. To add
one, write a handler and call ``register(JobKind(...))`` in ``workers/kinds/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schemas import JobParams

if TYPE_CHECKING:
    from workers.context import JobContext

Handler = Callable[["JobContext", Any], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class JobKind:
    name: str
    params: type[JobParams]
    collection: str
    handler: Handler
    media_type: Callable[[Any], str]
    suffix: Callable[[Any], str]
    media_types: tuple[str, ...]  # every media_type() can answer (for the API reference)
    deadline_s: float | None = None  # None: HERALD_JOB_DEADLINE_S

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.collection.startswith("/") or self.collection.count("/") != 1:
            raise ValueError(f"bad job kind {self.name!r} at {self.collection!r}")


_KINDS: dict[str, JobKind] = {}


def register(kind: JobKind) -> JobKind:
    if kind.name in _KINDS or any(k.collection == kind.collection for k in _KINDS.values()):
        raise ValueError(f"job kind {kind.name!r} or path {kind.collection!r} is registered twice")
    _KINDS[kind.name] = kind
    return kind


def kinds() -> dict[str, JobKind]:
    from workers import kinds as _builtin  # noqa: F401  (registers the built-in kinds)

    return _KINDS


def get(name: str) -> JobKind | None:
    return kinds().get(name)
