-- SQLite migration 3: tenants, API keys (hashes), the admin audit log and the directory's
-- version row (TenantStore, SPEC §12).

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
