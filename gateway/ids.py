"""What an id or a name in a request may look like before it reaches the store.

Job and delivery ids are UUIDs Herald made; a kind filter is a kind's name. Anything else
cannot name a row, so it is answered (404, or 400 naming the field) without asking the
store, which also keeps bytes no store column can hold (a NUL, say) away from it.
"""

from __future__ import annotations

import re

from gateway.problems import InvalidRequest
from schemas import FieldError

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_KIND = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def is_uuid(value: str) -> bool:
    """A UUID in the form Herald writes it (lower case, hyphenated)."""
    return _UUID.fullmatch(value) is not None


def kind_filter(value: str | None, field: str = "kind") -> str | None:
    """A ``?kind=`` filter: None, or a kind's name; else 400 naming the field."""
    if value is None or _KIND.fullmatch(value):
        return value
    raise InvalidRequest([FieldError(field=field, message="must be a job kind's name (letters, digits, _)")])
