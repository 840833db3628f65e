-- PostgreSQL migration 2: the job store's writes, each one statement from the client.
--
-- A database made before trace contexts were kept (its migration 1 had neither the columns
-- nor these functions' trace parameters) gets the columns, and loses the functions of the
-- old signatures; on any other database the first four statements do nothing.

ALTER TABLE jobs ADD COLUMN IF NOT EXISTS traceparent TEXT, ADD COLUMN IF NOT EXISTS tracestate TEXT;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS traceparent TEXT, ADD COLUMN IF NOT EXISTS tracestate TEXT;
DROP FUNCTION IF EXISTS herald_accept(TEXT, TEXT, TEXT, TEXT, BYTEA, TEXT, DOUBLE PRECISION, DOUBLE PRECISION,
    TEXT, TEXT, DOUBLE PRECISION, DOUBLE PRECISION, DOUBLE PRECISION, TEXT, BYTEA, BYTEA, TEXT, TEXT, BYTEA);
DROP FUNCTION IF EXISTS herald_append_event(TEXT, TEXT, TEXT, INTEGER, TEXT, DOUBLE PRECISION, BYTEA, TEXT, BYTEA,
    TEXT, TEXT, BYTEA);

-- herald_append_event: its definition is functions/jobs_writes.sql now (repeatable: applied whenever it changes).

-- herald_accept: its definition is functions/jobs_writes.sql now (repeatable: applied whenever it changes).

-- herald_transition: its definition is functions/jobs_writes.sql now (repeatable: applied whenever it changes).
