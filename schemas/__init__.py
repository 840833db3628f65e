"""Every wire shape Herald speaks, as msgspec Structs. Nothing else defines one."""

from schemas.base import Base
from schemas.jobs import JobLinks, JobList, JobStatus, JobState, TERMINAL_STATES, EventType
from schemas.kinds import ExportParams, JobParams, ReportParams
from schemas.messages import JobEvent, JobMessage, QueuedJob
from schemas.problems import FieldError, Problem

__all__ = [
    "Base",
    "EventType",
    "ExportParams",
    "FieldError",
    "JobEvent",
    "JobLinks",
    "JobList",
    "JobMessage",
    "JobParams",
    "JobState",
    "JobStatus",
    "Problem",
    "QueuedJob",
    "ReportParams",
    "TERMINAL_STATES",
]
