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
    """The work itself failed; the job ends ``failed`` with a problem of this type (its
    entry in ``schemas.problems``, the list of every problem type Herald emits)."""

    def __init__(self, kind: ProblemType, detail: str) -> None:
        super().__init__(detail)
        self.problem = kind.problem(detail)
