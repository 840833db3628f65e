-- PostgreSQL migration 18: a relay's batch reads its own process's rows through an index
-- (issue 24). herald_outbox_batch takes the oldest rows of one origin; with only the primary
-- key it walked every process's unpublished and published-not-yet-deleted rows in seq order
-- to find them, or sorted a sequential scan (1.2 ms at the 90th percentile under load, a
-- third of the time the batch read was planned that way).
CREATE INDEX IF NOT EXISTS outbox_by_origin ON outbox (origin, seq);
