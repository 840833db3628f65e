-- PostgreSQL migration 16: one index over the live jobs in place of five (issue 24, fewer
-- writes per job). A transition that changes the state cannot be a HOT update, so it adds
-- an entry to every index whose predicate the new row meets: an accept wrote six index
-- entries, a claim four. The queries that read live jobs all start from a state: a
-- tenant's running count (the capped claim, fair share), a tenant's oldest queued job of a
-- kind (back-pressure), the sweeper's live jobs, and /metrics' queue ages (a loose scan of
-- this index, tenant by tenant and kind by kind). heartbeat_at and updated_at are in no
-- index now, so a heartbeat (which changes nothing else) can be a HOT update.

DROP INDEX IF EXISTS jobs_live;
DROP INDEX IF EXISTS jobs_queued_since;
DROP INDEX IF EXISTS jobs_queued_by_kind;
DROP INDEX IF EXISTS jobs_running_by_tenant;
DROP INDEX IF EXISTS jobs_queued_by_tenant;
CREATE INDEX jobs_live_by_tenant ON jobs (state, tenant, kind, created_at)
    WHERE state = 'queued' OR state = 'running';
