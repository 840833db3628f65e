"""Decode a request body into a params Struct, naming every bad field (SPEC §3)."""

from __future__ import annotations

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


def validate_params(params_type: type[P], document: Any) -> P:
    """Check each field on its own so that every bad one is reported, then build the Struct."""
    if not isinstance(document, dict):
        raise InvalidBody([FieldError(field="$", message="the body must be a JSON object")])
    errors: list[FieldError] = []
    fields = {f.encode_name: f for f in msgspec.structs.fields(params_type)}
    for name in document:
        if name not in fields:
            errors.append(FieldError(field=str(name), message="unknown field"))
    for name, info in fields.items():
        if name not in document:
            if info.required:
                errors.append(FieldError(field=name, message="required"))
            continue
        try:
            msgspec.convert(document[name], type=info.type)
        except msgspec.ValidationError as exc:
            errors.append(FieldError(field=name, message=_message(exc)))
    if errors:
        raise InvalidBody(errors)
    params = msgspec.convert(document, type=params_type)
    errors = params.cross_field_errors()
    if errors:
        raise InvalidBody(errors)
    return params
