-- SQLite migration 5: one index over the live jobs in place of five (issue 24, fewer writes
-- per job). Every queued job had an entry in four indexes and every running one in two, so
-- an accept, a claim and a finish each rewrote pages of four to five b-trees. The queries
-- that read live jobs all start from a state: a tenant's running count (the capped claim,
-- fair share), a tenant's oldest queued job of a kind (back-pressure), the sweeper's live
-- jobs, and /metrics' queue ages (a loose scan of this index, tenant by tenant and kind by
-- kind). heartbeat_at is in no index now: a heartbeat writes only the row (the sweeper's
-- read never used it as a key: its deadline_at branch reads every live job anyway).
-- The predicate is written with OR so that a query's state = 'queued' (or 'running')
-- implies it; a query that reads both states repeats it literally.

DROP INDEX IF EXISTS jobs_live;
DROP INDEX IF EXISTS jobs_queued_since;
DROP INDEX IF EXISTS jobs_queued_by_kind;
DROP INDEX IF EXISTS jobs_running_by_tenant;
DROP INDEX IF EXISTS jobs_queued_by_tenant;
CREATE INDEX jobs_live_by_tenant ON jobs (state, tenant, kind, created_at)
    WHERE state = 'queued' OR state = 'running';
