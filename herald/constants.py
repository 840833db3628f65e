"""Names shared by every process: streams, consumers, subjects, headers."""

import re

# Bearer tokens Herald makes itself: an issued API key (``hk_<id>_<secret>``) and a portal
# session (``hps_…``). A key of HERALD_API_KEYS may not look like either.
ISSUED_KEY_PREFIX = "hk_"
PORTAL_TOKEN_PREFIX = "hps_"

JOBS_STREAM = "HERALD_JOBS"
EVENTS_STREAM = "HERALD_EVENTS"
# Streamed output (SPEC §8): chunks on ``output.<tenant token>.<job>``; the stream republishes
# each chunk it stored on ``herald-output-live.<tenant token>.<job>``, so that a live reader
# only ever sees chunks that are durable.
OUTPUT_STREAM = "HERALD_OUTPUT"
OUTPUT_SUBJECTS = "output.>"
OUTPUT_LIVE_PREFIX = "herald-output-live"
OUTPUT_LIVE_SUBJECTS = OUTPUT_LIVE_PREFIX + ".>"
# A chunk's headers: its number in the job's output and the job's output bytes up to and with it.
CHUNK_HEADER = "Herald-Chunk"
OUTPUT_BYTES_HEADER = "Herald-Output-Bytes"
MAX_CHUNK_BYTES = 64 * 1024
# Work messages are split by kind and tenant, ``jobs.<kind>.<tenant token>``, each pair with
# its own durable consumer ``herald-workers-<kind>-<tenant token>`` (created when first
# needed), so that workers can share their slots fairly among tenants (SPEC §13,
# workers/dispatch.py). Older Herald versions published ``jobs.<kind>`` and consumed it
# with ``herald-workers-<kind>`` (before that, ``herald-workers`` on ``jobs.>``, removed by
# ensure_topology); workers still drain those. The filters never overlap, which a
# work-queue stream requires of its consumers.
WORKERS_CONSUMER = "herald-workers"
NOTIFIER_CONSUMER = "herald-notifier"

# A tenant id as SPEC §12 allows it is a valid subject token and consumer-name part as it
# is. Every tenant is such an id (the admin API and HERALD_API_KEYS refuse others); anything
# else that reaches a subject all the same (a tenant an older Herald let in) is hex-encoded
# behind a '~', which no valid id starts with, so tokens never collide.
_PLAIN_TENANT = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_ENCODED_PREFIX = "~"


def tenant_token(tenant: str) -> str:
    """The tenant as one subject token (no '.', '*', '>' or whitespace) and consumer-name part."""
    if _PLAIN_TENANT.fullmatch(tenant):
        return tenant
    return _ENCODED_PREFIX + tenant.encode().hex()


def tenant_from_token(token: str) -> str:
    if token.startswith(_ENCODED_PREFIX):
        return bytes.fromhex(token[len(_ENCODED_PREFIX):]).decode()
    return token


def job_subject(kind: str, tenant: str | None = None) -> str:
    """The work subject of a tenant's jobs of ``kind``; without a tenant, the subject of an older Herald."""
    return f"jobs.{kind}" if tenant is None else f"jobs.{kind}.{tenant_token(tenant)}"


def worker_consumer_name(kind: str, token: str | None = None) -> str:
    """The durable consumer of one kind and tenant (token); without one, an older Herald's of the kind.
    Kind names hold no '-', so the name is unambiguous."""
    return f"{WORKERS_CONSUMER}-{kind}" if token is None else f"{WORKERS_CONSUMER}-{kind}-{token}"


# A job event's subject ends in its audience: ``notify`` when some webhook target wanted it
# as it was committed (a matching enabled endpoint of the tenant, or the job's callback URL),
# ``quiet`` when none did. Only ``notify`` events (and an older Herald's
# ``events.<tenant>.<job>``) are kept in the events stream, for the notifier's consumer: a
# ``quiet`` one has no durable reader, so the relay publishes it on core NATS to the gateways'
# hubs alone (most of a busy deployment's events, whose endpoints ask for outcomes), and it
# costs JetStream no write, replication or PubAck.
NOTIFY = "notify"
QUIET = "quiet"


def event_subject(tenant: str, job_id: str, notify: bool) -> str:
    return f"{event_subject_head(tenant, job_id)}.{NOTIFY if notify else QUIET}"


def event_subject_head(tenant: str, job_id: str) -> str:
    """A job event's subject without its audience, which PostgreSQL's ``herald_append_event``
    appends as it commits the event (an older Herald's whole subject)."""
    return f"events.{tenant_token(tenant)}.{job_id}"


def output_subject(tenant: str, job_id: str) -> str:
    """The subject of a job's streamed output chunks (SPEC §8), in ``OUTPUT_STREAM``."""
    return f"output.{tenant_token(tenant)}.{job_id}"


def output_live_subject(tenant: str, job_id: str) -> str:
    """Where JetStream republishes a chunk once it is stored (the gateways' hubs listen there)."""
    return f"{OUTPUT_LIVE_PREFIX}.{tenant_token(tenant)}.{job_id}"


def is_live_only(subject: str) -> bool:
    """Whether an outbox row is a ``quiet`` event: published on core NATS, not kept in a stream."""
    return subject.endswith("." + QUIET) and subject.startswith("events.")


JOB_SUBJECTS = "jobs.>"
EVENT_SUBJECTS = "events.>"  # what the gateways' hubs subscribe to: every event, kept or live only
# What the events stream keeps and the notifier's consumer takes: events some target wanted,
# and an older Herald's events (three tokens, no audience), which the notifier judges on receipt.
KEPT_EVENT_SUBJECTS = ["events.*.*." + NOTIFY, "events.*.*"]

MSG_ID_HEADER = "Nats-Msg-Id"

# The NATS object store bucket of results (HERALD_RESULT_STORE=nats). Its index by job,
# a key-value bucket, is named after it (herald.storage.results.index_bucket).
RESULTS_BUCKET = "HERALD_RESULTS"
