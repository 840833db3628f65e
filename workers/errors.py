"""How a handler (or the runtime around it) says a job must stop."""

from __future__ import annotations

from schemas.problems import ProblemType


class JobStop(Exception):
    """Base: the job's run ends here."""


class JobCancelled(JobStop):
    """The client asked to cancel; partial output is removed and the job ends ``cancelled``."""


class JobLost(JobStop):
    """Another writer moved the job on (re-queued, deadline, cancelled): stop quietly."""


class JobFailed(JobStop):
    """The work itself failed; the job ends ``failed`` (not retried) with a problem of this
    type: the job's ``error`` is ``{"type", "title", "detail"}``. Herald's own types are in
    ``schemas.problems``; a kind of your own declares its types as
    ``ProblemType("/problems/<your-type>", "A short title")``. ``detail`` is shown to the
    client: say what went wrong in their terms, never a stack trace."""

    def __init__(self, kind: ProblemType, detail: str) -> None:
        if not kind.type.startswith("/problems/"):
            raise ValueError(f"a problem type is a path under /problems/, got {kind.type!r}")
        super().__init__(detail)
        self.problem = kind.problem(detail)
