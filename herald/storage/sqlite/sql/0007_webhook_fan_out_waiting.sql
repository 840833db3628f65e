-- SQLite migration 7: job events whose fan-out waits for their tenant's share (SPEC §13,
-- herald.delivery_rules.share_fan_out). A row is the event as the stream carried it; a
-- tenant's rows are fanned out in seq order, the order they came in.
CREATE TABLE webhook_fan_out_waiting (
    seq INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    event BLOB NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX webhook_fan_out_waiting_by_tenant ON webhook_fan_out_waiting (tenant, seq);
