"""The schema as SQL files: each backend's numbered ``.sql`` files, read as package data.

A file may name constants that Python owns (a lock class, the clock expression) in braces,
``{now}``; they are filled in from the backend's parameters when the file is read. Only
names the backend passes are replaced, and a name it does not know is an error, so a typo
fails when the file is read rather than when its SQL runs. Any other brace (an array
literal such as ``'{}'``) is left alone: no escaping.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources

_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def read_sql(package: str, name: str, params: Mapping[str, object] | None = None) -> str:
    """The text of ``sql/<name>`` in ``package``, its placeholders filled in from ``params``."""
    text = (resources.files(package) / "sql" / name).read_text(encoding="utf-8")
    values = params or {}

    def fill(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in values:
            raise KeyError(f"sql/{name} in {package} names {{{key}}}, which its backend does not define")
        return str(values[key])

    return _PLACEHOLDER.sub(fill, text)
