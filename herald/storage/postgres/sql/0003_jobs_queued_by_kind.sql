-- PostgreSQL migration 3: per-kind queue age (/metrics, back-pressure), one index lookup per kind.
CREATE INDEX IF NOT EXISTS jobs_queued_by_kind ON jobs (kind, created_at) WHERE state = 'queued';
