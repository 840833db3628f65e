"""Start-request bodies of the built-in job kinds (SPEC §3)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas.base import Base
from schemas.problems import FieldError

CallbackUrl = Annotated[
    str,
    msgspec.Meta(min_length=8, max_length=2048, pattern="^https?://",
                 description="https URL that receives this job's events (public address)"),
]


class JobParams(Base, kw_only=True):
    """Fields every kind accepts. Subclasses add their own and may add cross-field checks."""

    callback_url: CallbackUrl | None = None

    def cross_field_errors(self) -> list[FieldError]:
        return []


class ReportParams(JobParams, kw_only=True):
    title: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    pages: Annotated[int, msgspec.Meta(ge=1, le=1000)]
    fail_on_page: Annotated[int, msgspec.Meta(ge=1, le=1000, description="demo knob: rendering fails on this page")] | None = None

    def cross_field_errors(self) -> list[FieldError]:
        if self.fail_on_page is not None and self.fail_on_page > self.pages:
            return [FieldError(field="fail_on_page", message=f"must be between 1 and pages ({self.pages})")]
        return []


class ExportParams(JobParams, kw_only=True):
    format: Literal["csv", "ndjson"]
    rows: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
