"""Facts of the README a test can check: every problem type Herald can emit (SPEC §10), every
variable it reads."""

from __future__ import annotations

import re
from pathlib import Path

from schemas.problems import PROBLEM_TYPES

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_lists_every_problem_type() -> None:
    text = README.read_text()
    missing = [p.type for p in PROBLEM_TYPES if f"`{p.type}`" not in text]
    assert not missing, f"README.md's Problem types do not mention: {', '.join(missing)}"


def _environment_variables() -> set[str]:
    """Every HERALD_* variable Settings.from_env reads (a setting's own name or its aliases)."""
    import dataclasses
    import typing

    from herald.settings import Env, Settings

    hints = typing.get_type_hints(Settings, include_extras=True)
    names: set[str] = set()
    for setting in dataclasses.fields(Settings):
        (how,) = (meta for meta in typing.get_args(hints[setting.name])[1:] if isinstance(meta, Env))
        names.update(f"HERALD_{name}" for name in how.names or (setting.name.upper(),))
    return names


def test_readme_configuration_table_is_every_variable_herald_reads() -> None:
    # The table says it is "every one Herald reads": a variable missing from it is a setting
    # a newcomer cannot find, and one only in it is a setting that does nothing.
    section = README.read_text().split("\n## Configuration\n", 1)[1].split("\n### ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `HERALD_")]
    listed = set(re.findall(r"`(HERALD_[A-Z0-9_]+)`", "".join(rows)))
    read = _environment_variables()
    assert not read - listed, f"README.md's Configuration table lacks {sorted(read - listed)}"
    assert not listed - read, f"README.md's Configuration table lists what Herald never reads: {sorted(listed - read)}"


def test_openapi_documents_the_headers_a_status_304_carries(tmp_path: Path) -> None:
    # GET /jobs/{id} answers 304 with the headers of the 200 it stands for (ETag, and while
    # the job is queued or running Retry-After and Cache-Control: a long poll that timed
    # out says when to ask again); the document named only the ETag.
    from herald.settings import Settings

    from gateway.app import create_app

    app = create_app(Settings.from_env({}).with_changes(data_dir=tmp_path))
    responses = app.openapi_schema.to_schema()["paths"]["/jobs/{job_id}"]["get"]["responses"]
    assert set(responses["304"]["headers"]) == set(responses["200"]["headers"]) == {"ETag", "Retry-After", "Cache-Control"}
