-- PostgreSQL migration 11: tenants, API keys (hashes), the admin audit log and the
-- directory's version row (TenantStore, SPEC §12).

CREATE TABLE IF NOT EXISTS herald_tenants (
    id TEXT PRIMARY KEY,
    created_at DOUBLE PRECISION NOT NULL,
    disabled BOOLEAN NOT NULL DEFAULT false,
    source TEXT NOT NULL DEFAULT 'api',
    limits JSONB NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS herald_api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    scopes TEXT NOT NULL,
    digest BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION,
    last_used_at DOUBLE PRECISION,
    revoked_at DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS herald_api_keys_tenant ON herald_api_keys (tenant, created_at);
CREATE TABLE IF NOT EXISTS herald_audit (
    seq BIGSERIAL PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL,
    action TEXT NOT NULL,
    tenant TEXT,
    key_id TEXT,
    detail JSONB NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS herald_directory (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL
);
INSERT INTO herald_directory (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;
