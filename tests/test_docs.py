"""The README documents every problem type Herald can emit (SPEC §10), from the one list."""

from __future__ import annotations

from pathlib import Path

from schemas.problems import PROBLEM_TYPES

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_lists_every_problem_type() -> None:
    text = README.read_text()
    missing = [p.type for p in PROBLEM_TYPES if f"`{p.type}`" not in text]
    assert not missing, f"README.md's Problem types do not mention: {', '.join(missing)}"
