"""Workers: JetStream pull consumers that run job kinds.

A handler needs only these: ``from workers import JobContext, JobFailed`` (and
``schemas.problems.ProblemType`` for its own problem types).
"""

from workers.context import JobContext
from workers.errors import JobCancelled, JobFailed, JobLost
from workers.output import ChunkTooLarge, OutputClosed, OutputTooLarge

__all__ = ["ChunkTooLarge", "JobCancelled", "JobContext", "JobFailed", "JobLost", "OutputClosed", "OutputTooLarge"]
