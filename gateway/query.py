"""A query string as the route declares it: each parameter once, an integer in ASCII digits.

Litestar reads a parameter given twice as its last value, and an integer with msgspec's lax
conversion from a string, which takes float spellings: ``?limit=1&limit=100`` was read as 100,
``?wait=1e1`` as 10 and ``?limit=2.0`` as 2, where every bad value is a 400 naming it
(SPEC §10). ``check_query`` runs in the app's ``before_request`` hook, before the framework
reads the parameters, and answers those with ``/problems/invalid-request`` naming each one.
A parameter no route declares is not looked at (a cache buster, say).
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.handlers import BaseRouteHandler
from litestar.params import ParameterKwarg, ParamType

from gateway.problems import InvalidRequest
from schemas import FieldError

_INTEGER = re.compile(r"-?[0-9]+")  # not str.isdigit(), which takes '²' and '٣'


@dataclass(frozen=True, slots=True)
class _Declared:
    names: tuple[str, ...]  # as the query spells them
    integers: frozenset[str]


# Where a handler keeps what it declares, worked out on its first request: in its own ``opt``,
# so it lives as long as the handler (the framework's OPTIONS handlers take no weak reference).
_DECLARED_OPT = "herald.query"


def _is_integer(annotation: Any) -> bool:
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    return int in options


def _declared_by(handler: BaseRouteHandler) -> _Declared:
    found: _Declared | None = handler.opt.get(_DECLARED_OPT)
    if found is None:
        names: list[str] = []
        integers: set[str] = set()
        for name, field in handler.parsed_fn_signature.parameters.items():
            kwarg = field.kwarg_definition
            if not isinstance(kwarg, ParameterKwarg) or kwarg.param_type is not ParamType.QUERY:
                continue  # the request itself, a path parameter, a header
            spelled = kwarg.name or kwarg.query or name  # QueryParameter(name=...), as the query spells it
            names.append(spelled)
            if _is_integer(field.annotation):
                integers.add(spelled)
        found = handler.opt[_DECLARED_OPT] = _Declared(tuple(names), frozenset(integers))
    return found


def check_query(request: Request[Any, Any, Any]) -> None:
    """400 naming each declared parameter given more than once, or an integer that is not one."""
    if not request.scope.get("query_string"):
        return
    declared = _declared_by(request.route_handler)
    if not declared.names:
        return
    query = request.query_params
    errors: list[FieldError] = []
    for name in declared.names:
        values = query.getall(name, [])
        if len(values) > 1:
            errors.append(FieldError(field=name, message="given more than once: send it once"))
        elif values and name in declared.integers and not _INTEGER.fullmatch(values[0]):
            errors.append(FieldError(field=name, message="must be an integer, in ASCII digits"))
    if errors:
        raise InvalidRequest(errors)
