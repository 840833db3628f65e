"""Names shared by every process: streams, consumers, subjects, headers."""

JOBS_STREAM = "HERALD_JOBS"
EVENTS_STREAM = "HERALD_EVENTS"
# Each kind has its own durable consumer, ``herald-workers-<kind>`` on ``jobs.<kind>``, so a
# worker pulls only the kinds it serves. ``herald-workers`` alone is the single consumer of
# every kind that Herald used before (removed by ensure_topology: on a work-queue stream
# consumers may not overlap).
WORKERS_CONSUMER = "herald-workers"
NOTIFIER_CONSUMER = "herald-notifier"


def job_subject(kind: str) -> str:
    return f"jobs.{kind}"


def worker_consumer_name(kind: str) -> str:
    return f"{WORKERS_CONSUMER}-{kind}"


def event_subject(tenant: str, job_id: str) -> str:
    return f"events.{tenant}.{job_id}"


JOB_SUBJECTS = "jobs.>"
EVENT_SUBJECTS = "events.>"

MSG_ID_HEADER = "Nats-Msg-Id"

# The NATS object store bucket of results (HERALD_RESULT_STORE=nats). Its index by job,
# a key-value bucket, is named after it (herald.storage.results.index_bucket).
RESULTS_BUCKET = "HERALD_RESULTS"
