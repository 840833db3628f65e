-- SQLite migration 4: the schema facts PostgreSQL already had (issue 23 §1), so that the two
-- stores differ in dialect and in the indexes their planners want, not in what they promise.

-- At most one current signing key per owner, whatever races (PostgreSQL: webhook_keys_current).
CREATE UNIQUE INDEX IF NOT EXISTS webhook_keys_current ON webhook_keys (owner) WHERE retire_at IS NULL;

-- Forgetting a job's idempotency keys finds them by job, not by a scan (PostgreSQL:
-- idempotency_by_job).
CREATE INDEX IF NOT EXISTS idempotency_by_job ON idempotency_keys (job_id);

-- One delivery per event and target, keyed event first as in PostgreSQL: the probe of
-- pruning ("does any delivery still need this message body?") is by event, and with the
-- target first it scanned every delivery for each message. A UNIQUE constraint cannot be
-- altered in SQLite, so the table is made again; its rows keep their seq, and the next seq
-- continues where the old table's left off (AUTOINCREMENT: never one used before).
CREATE TABLE webhook_deliveries_new (
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
    UNIQUE (event_id, target)
);
INSERT INTO webhook_deliveries_new (seq, id, tenant, target, endpoint_id, url, event_id, job_id, version, type,
                                    status, attempts, scheduled_at, next_attempt_at, lease_owner, lease_until,
                                    created_at, updated_at)
SELECT seq, id, tenant, target, endpoint_id, url, event_id, job_id, version, type,
       status, attempts, scheduled_at, next_attempt_at, lease_owner, lease_until, created_at, updated_at
  FROM webhook_deliveries;
INSERT INTO sqlite_sequence (name, seq)
SELECT 'webhook_deliveries_new', 0
 WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'webhook_deliveries_new');
UPDATE sqlite_sequence
   SET seq = max(seq, coalesce((SELECT s.seq FROM sqlite_sequence s WHERE s.name = 'webhook_deliveries'), 0))
 WHERE name = 'webhook_deliveries_new';
DROP TABLE webhook_deliveries;
ALTER TABLE webhook_deliveries_new RENAME TO webhook_deliveries;
-- Every index of migration 2 again, as it made them (a table dropped takes its indexes along).
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (target, job_id, version);
-- The claim: which tenants have pending deliveries, each one's targets, and each target's in
-- due order (seq, the rowid, ends every index, so ties are in seq order too).
CREATE INDEX webhook_deliveries_pending_by_tenant
    ON webhook_deliveries (tenant, target, next_attempt_at) WHERE status = 'pending';
-- The claim of Herald before the one above (a notifier of it may still run during an upgrade),
-- and rescheduling a paced target's due deliveries.
CREATE INDEX webhook_deliveries_pending_by_target ON webhook_deliveries (target, next_attempt_at)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_endpoint ON webhook_deliveries (endpoint_id, seq);
CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (updated_at) WHERE status != 'pending';
