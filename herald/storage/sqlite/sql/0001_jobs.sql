-- SQLite migration 1: the job store (jobs, their history, the outbox, idempotency keys,
-- tombstones, start budgets, secrets).
-- State names below are the values of schemas.jobs.JobState (the one list), written out
-- because a query must repeat a partial index's predicate literally for the planner to use
-- the index.

CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    kind TEXT NOT NULL,
    collection TEXT NOT NULL,
    state TEXT NOT NULL,
    params BLOB NOT NULL,
    progress INTEGER,
    version INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    heartbeat_at REAL,
    deadline_at REAL NOT NULL,
    finished_at REAL,
    expires_at REAL,
    result_path TEXT,
    media_type TEXT,
    error BLOB,
    callback_url TEXT,
    traceparent TEXT,
    tracestate TEXT,
    result_body BLOB
);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, created_at DESC, id DESC);
CREATE INDEX IF NOT EXISTS jobs_live ON jobs (state, heartbeat_at) WHERE state IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS jobs_queued_since ON jobs (created_at) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS jobs_queued_by_kind ON jobs (kind, created_at) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS jobs_expiring ON jobs (expires_at) WHERE expires_at IS NOT NULL;
-- SPEC §13: a capped tenant's running jobs (the claim), a tenant's own queue age (back-pressure).
CREATE INDEX IF NOT EXISTS jobs_running_by_tenant ON jobs (tenant) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS jobs_queued_by_tenant ON jobs (kind, tenant, created_at) WHERE state = 'queued';

CREATE TABLE IF NOT EXISTS events (
    tenant TEXT NOT NULL,
    seq INTEGER NOT NULL,
    job_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    at REAL NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (tenant, seq)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS events_by_job ON events (job_id, version);

CREATE TABLE IF NOT EXISTS tenant_seq (tenant TEXT PRIMARY KEY, last INTEGER NOT NULL);

CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    subject TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    payload BLOB NOT NULL,
    created_at REAL NOT NULL,
    traceparent TEXT,
    tracestate TEXT,
    origin TEXT
);

CREATE TABLE IF NOT EXISTS idempotency_keys (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    job_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_expiring ON idempotency_keys (expires_at);

CREATE TABLE IF NOT EXISTS tombstones (
    job_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    deleted_at REAL NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS rate_buckets (
    tenant TEXT PRIMARY KEY,
    tokens REAL NOT NULL,
    at REAL NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS herald_secrets (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL
) WITHOUT ROWID;
