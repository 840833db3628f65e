-- PostgreSQL migration 15: a small JSON result lives in the job's row (issue 24), as it does
-- on SQLite since its result_body column: the success's own transaction keeps it, so a worker
-- writes no result object (two JetStream round trips and an index entry on the result store)
-- and the gateway serves it from the row it reads anyway.
ALTER TABLE jobs ADD COLUMN result_body BYTEA;

-- herald_transition and herald_claim_capped take the result (p_result_body, after
-- p_media_type): the signatures without it go. Their definitions are functions/jobs_writes.sql.
DROP FUNCTION IF EXISTS herald_claim_capped(
    INTEGER, TEXT, INTEGER, DOUBLE PRECISION, TEXT, INTEGER, INTEGER, BOOLEAN, DOUBLE PRECISION, BYTEA, TEXT, TEXT,
    DOUBLE PRECISION, DOUBLE PRECISION, DOUBLE PRECISION, TEXT, TEXT, BYTEA, BYTEA, TEXT, TEXT, BYTEA);
DROP FUNCTION IF EXISTS herald_transition(
    TEXT, INTEGER, DOUBLE PRECISION, TEXT, INTEGER, INTEGER, BOOLEAN, DOUBLE PRECISION, BYTEA, TEXT, TEXT,
    DOUBLE PRECISION, DOUBLE PRECISION, DOUBLE PRECISION, TEXT, TEXT, BYTEA, BYTEA, TEXT, TEXT, BYTEA);
