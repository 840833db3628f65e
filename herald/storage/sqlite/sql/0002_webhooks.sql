-- SQLite migration 2: webhook endpoints, signing keys, messages, deliveries and attempts.

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
