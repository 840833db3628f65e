-- PostgreSQL migration 20: herald_accept returns a named row type, herald_accepted, where it
-- had OUT parameters (an anonymous record). A gateway's accepts then go as one statement per
-- group commit, `SELECT herald_accept(...) AS r0, herald_accept(...) AS r1, ...`, as a
-- worker's transitions do (herald.storage.postgres.db._Combined): the driver decodes a named
-- row type in a select list, not an anonymous record holding a table's row. Before, a batch
-- of accepts was BEGIN, one round trip per accept, COMMIT; PostgreSQL's sessions spent a
-- third of an accept burst waiting for the gateway's next statement (Client/ClientRead).
-- The function of the old form goes (the repeatable sql/functions/jobs_writes.sql makes the
-- new one): upgrade every gateway together.
DROP FUNCTION IF EXISTS herald_accept(TEXT, TEXT, TEXT, TEXT, BYTEA, TEXT, DOUBLE PRECISION, DOUBLE PRECISION,
    TEXT, TEXT, DOUBLE PRECISION, DOUBLE PRECISION, DOUBLE PRECISION, TEXT, BYTEA, BYTEA, TEXT, TEXT, BYTEA,
    TEXT, TEXT);
CREATE TYPE herald_accepted AS (outcome TEXT, wait_s DOUBLE PRECISION, event_seq BIGINT, job jobs);
