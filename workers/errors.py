"""How a handler (or the runtime around it) says a job must stop."""

from __future__ import annotations

from schemas import Problem


class JobStop(Exception):
    """Base: the job's run ends here."""


class JobCancelled(JobStop):
    """The client asked to cancel; partial output is removed and the job ends ``cancelled``."""


class JobLost(JobStop):
    """Another writer moved the job on (re-queued, deadline, cancelled): stop quietly."""


class JobFailed(JobStop):
    """The work itself failed; the job ends ``failed`` with this problem."""

    def __init__(self, type_: str, title: str, detail: str) -> None:
        super().__init__(detail)
        self.problem = Problem(type=type_, title=title, detail=detail)
