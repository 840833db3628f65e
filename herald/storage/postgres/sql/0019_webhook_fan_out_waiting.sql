-- PostgreSQL migration 19: job events whose fan-out waits for their tenant's share (SPEC §13,
-- herald.delivery_rules.share_fan_out). A row is what the fan-out needs of the event, its
-- webhook body made; a tenant's rows are fanned out in seq order, the order they came in.
-- The fan-out functions take the share now and say how much waits: their old forms go (the
-- repeatable sql/functions/webhooks_fan_out.sql makes the new ones). Upgrade every notifier
-- together, as for migration 10.
CREATE TABLE IF NOT EXISTS webhook_fan_out_waiting (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant TEXT NOT NULL,
    job_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    kind TEXT NOT NULL,
    event_id TEXT NOT NULL,
    body BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS webhook_fan_out_waiting_by_tenant ON webhook_fan_out_waiting (tenant, seq);

DROP FUNCTION IF EXISTS herald_webhook_fan_out_touching(TEXT[], TEXT[], INTEGER[], TEXT[], TEXT[], TEXT[], BYTEA[],
                                                        DOUBLE PRECISION);
DROP FUNCTION IF EXISTS herald_webhook_fan_out(TEXT[], TEXT[], INTEGER[], TEXT[], TEXT[], TEXT[], BYTEA[],
                                               DOUBLE PRECISION);
DROP FUNCTION IF EXISTS herald_webhook_fan_out_leasing(TEXT[], TEXT[], INTEGER[], TEXT[], TEXT[], TEXT[], BYTEA[],
                                                       DOUBLE PRECISION, TEXT, DOUBLE PRECISION, INTEGER, INTEGER,
                                                       TEXT[], INTEGER[], INTEGER, TEXT[], INTEGER[], TEXT[]);
