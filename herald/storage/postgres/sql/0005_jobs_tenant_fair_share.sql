-- PostgreSQL migration 5 (SPEC §13). A capped claim (Change.max_running) locks the job row,
-- then the tenant's counter row (the order every write takes them in), counts the tenant's
-- running jobs and only then transitions: two capped claims of one tenant are serialised,
-- so both cannot take its last slot. -1: the tenant is at its cap. Claims without a cap
-- never come here.

CREATE INDEX IF NOT EXISTS jobs_running_by_tenant ON jobs (tenant) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS jobs_queued_by_tenant ON jobs (kind, tenant, created_at) WHERE state = 'queued';

-- herald_claim_capped: its definition is functions/jobs_writes.sql now (repeatable: applied whenever it changes).
