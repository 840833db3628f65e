-- PostgreSQL migration 21: an attempt carries its own id (herald.deliveries.Attempted.id), chosen
-- by the notifier before it first records the attempt. A record whose answer was lost (the
-- commit made, the connection cut before its answer came back) is recorded again; a store that
-- already holds an attempt of that id for the delivery writes nothing then, so one POST is one
-- row of the delivery's history. Attempts recorded before have none (NULL). No index: the check
-- reads the delivery's own attempts through the primary key (delivery_id, n), under the job and
-- target's order lock that every finish of the delivery takes.
ALTER TABLE webhook_attempts ADD COLUMN attempt_id TEXT;
-- The finish functions take the id as a last argument, NULL by default, so a notifier of the
-- Herald before this one still records (without the check) during a rolling upgrade; the
-- functions of the old form go (the repeatable sql/functions/webhooks_finish.sql makes the new).
DROP FUNCTION IF EXISTS herald_webhook_finish(TEXT, TEXT, TEXT, TEXT, DOUBLE PRECISION, INTEGER, DOUBLE PRECISION,
    TEXT, BYTEA, BOOLEAN, TEXT, DOUBLE PRECISION, BOOLEAN, DOUBLE PRECISION);
DROP FUNCTION IF EXISTS herald_webhook_finish_many(TEXT[], TEXT[], TEXT[], TEXT, DOUBLE PRECISION[], INTEGER[],
    DOUBLE PRECISION[], TEXT[], BYTEA[], BOOLEAN[], TEXT[], DOUBLE PRECISION[], BOOLEAN[], DOUBLE PRECISION);
