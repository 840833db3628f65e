-- PostgreSQL migration 6: the webhook tables (endpoints, keys, messages, deliveries, attempts).

CREATE TABLE webhook_endpoints (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    url TEXT NOT NULL,
    event_types TEXT[] NOT NULL,
    kinds TEXT[],
    signature TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    failing_since DOUBLE PRECISION
);
CREATE INDEX webhook_endpoints_by_tenant ON webhook_endpoints (tenant, created_at DESC, id DESC);

CREATE TABLE webhook_keys (
    owner TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    algorithm TEXT NOT NULL,
    secret BYTEA NOT NULL,
    public_key BYTEA,
    retire_at DOUBLE PRECISION,
    PRIMARY KEY (owner, created_at)
);
-- At most one current key per owner, whatever races.
CREATE UNIQUE INDEX webhook_keys_current ON webhook_keys (owner) WHERE retire_at IS NULL;

CREATE TABLE webhook_messages (
    event_id TEXT PRIMARY KEY,
    body BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE webhook_deliveries (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
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
    scheduled_at DOUBLE PRECISION NOT NULL,
    next_attempt_at DOUBLE PRECISION,
    lease_owner TEXT,
    lease_until DOUBLE PRECISION,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    -- event_id first: the idempotency key of fan-out and the probe of message pruning
    UNIQUE (event_id, target)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
-- One job's deliveries to one target: superseding, progress throttling, finish.
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (target, job_id, version);
-- The claim's ordering rule looks only at what is pending, per target and job.
CREATE INDEX webhook_deliveries_pending_order ON webhook_deliveries (target, job_id, version)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_endpoint ON webhook_deliveries (endpoint_id, seq);
CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (updated_at) WHERE status <> 'pending';

CREATE TABLE webhook_attempts (
    delivery_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    status_code INTEGER,
    latency_ms DOUBLE PRECISION,
    error TEXT,
    response BYTEA,
    PRIMARY KEY (delivery_id, n)
);
