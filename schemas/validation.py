"""Decode a request body into a params Struct, naming every bad field (SPEC §3)."""

from __future__ import annotations

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


def _message(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    cut = text.rfind(" - at `")
    return text[:cut] if cut >= 0 else text


def decode_json(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise MalformedBody(str(exc)) from exc


@cache
def _fields(params_type: type[JobParams]) -> dict[str, msgspec.structs.FieldInfo]:
    # msgspec.structs.fields() evaluates the class's annotations on every call.
    return {f.encode_name: f for f in msgspec.structs.fields(params_type)}


def validate_params(params_type: type[P], document: Any) -> P:
    """Build the Struct; if that fails, check each field on its own so that every bad one is reported."""
    if not isinstance(document, dict):
        raise InvalidBody([FieldError(field="$", message="the body must be a JSON object")])
    try:
        # A valid body (the hot path) is one conversion; only an invalid one pays for the
        # field-by-field walk below, which names every bad field instead of the first.
        params = msgspec.convert(document, type=params_type)
    except msgspec.ValidationError as exc:
        # Field by field finds the same faults; "$" only if a rule spans fields.
        raise InvalidBody(_field_errors(params_type, document)
                          or [FieldError(field="$", message=_message(exc))]) from None
    errors = params.cross_field_errors()
    if errors:
        raise InvalidBody(errors)
    return params


def _field_errors(params_type: type[JobParams], document: dict[str, Any]) -> list[FieldError]:
    fields = _fields(params_type)
    errors = [FieldError(field=str(name), message="unknown field") for name in document if name not in fields]
    for name, info in fields.items():
        if name not in document:
            if info.required:
                errors.append(FieldError(field=name, message="required"))
            continue
        try:
            msgspec.convert(document[name], type=info.type)
        except msgspec.ValidationError as exc:
            errors.append(FieldError(field=name, message=_message(exc)))
    return errors
