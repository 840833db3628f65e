-- The SQLite schema as Herald made it before herald/storage/migrations.py (main at 3411d9e):
-- the script every open ran. tests/test_migrations.py upgrades a database made from this file.

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

CREATE TABLE IF NOT EXISTS webhook_endpoints (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    url TEXT NOT NULL,
    event_types TEXT NOT NULL,
    kinds TEXT,
    signature TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    failing_since REAL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS webhook_endpoints_by_tenant ON webhook_endpoints (tenant, created_at DESC, id DESC);

CREATE TABLE IF NOT EXISTS webhook_keys (
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    algorithm TEXT NOT NULL,
    secret BLOB NOT NULL,
    public_key BLOB,
    retire_at REAL,
    PRIMARY KEY (owner, created_at)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS webhook_messages (
    event_id TEXT PRIMARY KEY,
    body BLOB NOT NULL,
    created_at REAL NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS webhook_deliveries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    target TEXT NOT NULL,
    endpoint_id TEXT,
    url TEXT,
    event_id TEXT NOT NULL,
    job_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    scheduled_at REAL NOT NULL,
    next_attempt_at REAL,
    lease_owner TEXT,
    lease_until REAL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE (target, event_id)
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS webhook_deliveries_order ON webhook_deliveries (target, job_id, version);
-- The claim: which tenants have pending deliveries, each one's targets, and each target's in
-- due order (seq, the rowid, ends every index, so ties are in seq order too).
CREATE INDEX IF NOT EXISTS webhook_deliveries_pending_by_tenant
    ON webhook_deliveries (tenant, target, next_attempt_at) WHERE status = 'pending';
-- The claim of Herald before the one above (a notifier of it may still run during an upgrade),
-- and rescheduling a paced target's due deliveries.
CREATE INDEX IF NOT EXISTS webhook_deliveries_pending_by_target ON webhook_deliveries (target, next_attempt_at)
    WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_endpoint ON webhook_deliveries (endpoint_id, seq);
CREATE INDEX IF NOT EXISTS webhook_deliveries_finished ON webhook_deliveries (updated_at) WHERE status != 'pending';

CREATE TABLE IF NOT EXISTS webhook_attempts (
    delivery_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    at REAL NOT NULL,
    status_code INTEGER,
    latency_ms REAL,
    error TEXT,
    response BLOB,
    PRIMARY KEY (delivery_id, n)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS herald_tenants (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    disabled INTEGER NOT NULL DEFAULT 0,
    source TEXT NOT NULL DEFAULT 'api',
    limits TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS herald_api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    scopes TEXT NOT NULL,
    digest BLOB NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    last_used_at REAL,
    revoked_at REAL
);
CREATE INDEX IF NOT EXISTS herald_api_keys_tenant ON herald_api_keys (tenant, created_at);
CREATE TABLE IF NOT EXISTS herald_audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    action TEXT NOT NULL,
    tenant TEXT,
    key_id TEXT,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS herald_directory (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
);
INSERT OR IGNORE INTO herald_directory (id, version) VALUES (1, 0);
