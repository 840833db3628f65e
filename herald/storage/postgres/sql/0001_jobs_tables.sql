-- PostgreSQL migration 1: the job store's tables. Columns named and typed as SQLite's (times
-- are Unix seconds, blobs are BYTEA), so rows map onto JobRow and other components (the
-- notifier's fan-out) read jobs by name.
-- State names below are the values of schemas.jobs.JobState (the one list), written out
-- because a query must repeat a partial index's predicate literally for the planner to use
-- the index.

CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    kind TEXT NOT NULL,
    collection TEXT NOT NULL,
    state TEXT NOT NULL,
    params BYTEA NOT NULL,
    progress INTEGER,
    version INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION,
    deadline_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION,
    expires_at DOUBLE PRECISION,
    result_path TEXT,
    media_type TEXT,
    error BYTEA,
    callback_url TEXT,
    traceparent TEXT,
    tracestate TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, created_at DESC, id DESC);
CREATE INDEX IF NOT EXISTS jobs_live ON jobs (state, heartbeat_at) WHERE state IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS jobs_queued_since ON jobs (created_at) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS jobs_expiring ON jobs (expires_at) WHERE expires_at IS NOT NULL;

CREATE TABLE IF NOT EXISTS events (
    tenant TEXT NOT NULL,
    seq BIGINT NOT NULL,
    job_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (tenant, seq)
);
CREATE UNIQUE INDEX IF NOT EXISTS events_by_job ON events (job_id, version);

CREATE TABLE IF NOT EXISTS tenant_seq (tenant TEXT PRIMARY KEY, last BIGINT NOT NULL);

CREATE TABLE IF NOT EXISTS outbox (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subject TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    payload BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    traceparent TEXT,
    tracestate TEXT
);

CREATE TABLE IF NOT EXISTS idempotency_keys (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    job_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS idempotency_expiring ON idempotency_keys (expires_at);
-- forget() deletes a job's keys by job id.
CREATE INDEX IF NOT EXISTS idempotency_by_job ON idempotency_keys (job_id);

CREATE TABLE IF NOT EXISTS tombstones (
    job_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    deleted_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE IF NOT EXISTS rate_buckets (
    tenant TEXT PRIMARY KEY,
    tokens DOUBLE PRECISION NOT NULL,
    at DOUBLE PRECISION NOT NULL
);

CREATE TABLE IF NOT EXISTS herald_secrets (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
