"""Decode a request body into a params Struct, naming every bad field (SPEC §3)."""

from __future__ import annotations

import json
import math
import types
import typing
from functools import cache
from typing import Any, TypeVar

import msgspec

from schemas.kinds import JobParams
from schemas.problems import FieldError

P = TypeVar("P", bound=JobParams)


class MalformedBody(ValueError):
    """The body is not JSON at all."""


class InvalidBody(ValueError):
    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in errors))
        self.errors = errors


def _message(exc: msgspec.MsgspecError) -> str:
    return _split(exc)[0]


def _split(exc: msgspec.MsgspecError) -> tuple[str, str]:
    """msgspec's message and the path it names inside the value (``.rate_limit``, ``[0]``),
    without its leading ``$``; no path: ``""``."""
    text = str(exc)
    cut = text.rfind(" - at `$")
    if cut < 0 or not text.endswith("`"):
        return text, ""
    return text[:cut], text[cut + len(" - at `$"):-1]


def decode_json(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        if str(exc).startswith("Number out of range") and (path := _out_of_range(body)):
            # JSON, but a number no double holds (1e309): a bad value of a field it can name.
            raise InvalidBody([_field_error(path, "number out of range")]) from None
        raise MalformedBody(str(exc)) from exc
    except RecursionError:  # msgspec refuses to nest deeper than the interpreter can follow
        raise MalformedBody("the JSON is nested too deeply") from None


def _out_of_range(body: bytes) -> str:
    """Where the first number out of range is (msgspec's message says only ``$[...]``): the
    standard parser reads it as infinity. Only ever on a body msgspec refused for that."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    return _first_infinite(value, "")


def _field_error(path: str, message: str) -> FieldError:
    """A fault at ``path`` inside the body: a field inside an object is named by its dotted
    path (``limits.rate_limit``); inside a list, the list names it and the rest of the path
    leads the message (``event_types`` / ``[0]: ...``)."""
    cut = path.find("[", 1)
    field, inner = (path, "") if cut < 0 else (path[:cut], path[cut:])
    if not field or field.startswith("["):
        return FieldError(field="$", message=f"{path}: {message}")
    return FieldError(field=field, message=f"{inner}: {message}" if inner else message)


def _first_infinite(value: Any, path: str) -> str:
    if isinstance(value, float) and math.isinf(value):
        return path or "$"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = (f"{path}.{key}" if path else key) if isinstance(key, str) else f"{path}[{key}]"
        if found := _first_infinite(item, inner):
            return found
    return ""


@cache
def _fields(params_type: type[msgspec.Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    # msgspec.structs.fields() evaluates the class's annotations on every call.
    return {f.encode_name: f for f in msgspec.structs.fields(params_type)}


@cache
def _nested_struct(annotation: Any) -> type[msgspec.Struct] | None:
    """The one Struct type a field may hold as an object (``LimitsPatch | None``), if any."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    structs = [o for o in options if isinstance(o, type) and issubclass(o, msgspec.Struct)]
    return structs[0] if len(structs) == 1 else None


def validate_params(params_type: type[P], document: Any) -> P:
    """Build the Struct; if that fails, check each field on its own so that every bad one is reported."""
    if not isinstance(document, dict):
        raise InvalidBody([FieldError(field="$", message="the body must be a JSON object")])
    try:
        # A valid body (the hot path) is one conversion; only an invalid one pays for the
        # field-by-field walk below, which names every bad field instead of the first.
        params = msgspec.convert(document, type=params_type)
    except RecursionError:
        raise InvalidBody([FieldError(field="$", message="nested too deeply")]) from None
    except msgspec.ValidationError as exc:
        # Field by field finds the same faults; "$" only if a rule spans fields.
        raise InvalidBody(_field_errors(params_type, document)
                          or [FieldError(field="$", message=_message(exc))]) from None
    errors = params.cross_field_errors()
    if errors:
        raise InvalidBody(errors)
    return params


def _field_errors(params_type: type[msgspec.Struct], document: dict[str, Any]) -> list[FieldError]:
    fields = _fields(params_type)
    errors = [FieldError(field=str(name), message="unknown field") for name in document if name not in fields]
    for name, info in fields.items():
        if name not in document:
            if info.required:
                errors.append(FieldError(field=name, message="required"))
            continue
        try:
            msgspec.convert(document[name], type=info.type)
        except RecursionError:
            errors.append(FieldError(field=name, message="nested too deeply"))
        except msgspec.ValidationError as exc:
            nested = _nested_struct(info.type)
            if nested is not None and isinstance(document[name], dict) and (
                    inner := _field_errors(nested, document[name])):
                # An object of named fields: each bad one of them, by its path (limits.rate_limit).
                errors.extend(FieldError(field=name if e.field == "$" else f"{name}.{e.field}", message=e.message)
                              for e in inner)
                continue
            message, path = _split(exc)  # inside the field (limits.rate_limit, event_types[0]): said so
            errors.append(_field_error(name + path, message))
    return errors
