-- SQLite migration 6: the events table keyed by rowid, its (tenant, seq) key a unique index
-- (issue 24, fewer writes per job). As a WITHOUT ROWID table the rows themselves (each a
-- whole status snapshot, some 500 bytes) were ordered by (tenant, seq): every tenant's
-- next event went into the middle of the tree, and its page splits rewrote neighbouring
-- pages: 8.7 of a trivial job's 14.6 WAL frames (bench.jobwrites, 8 jobs at once). Now a
-- row is appended at the table's end and only its small index entries go in key order.
-- Same columns, same uniqueness, same reads (a tenant's events by seq, a job's by version).
CREATE TABLE events_new (
    tenant TEXT NOT NULL,
    seq INTEGER NOT NULL,
    job_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    at REAL NOT NULL,
    data BLOB NOT NULL
);
INSERT INTO events_new (tenant, seq, job_id, kind, version, type, at, data)
SELECT tenant, seq, job_id, kind, version, type, at, data FROM events;
DROP TABLE events;
ALTER TABLE events_new RENAME TO events;
CREATE UNIQUE INDEX events_by_seq ON events (tenant, seq);
-- Every index of migration 1 again, as it made it (a table dropped takes its indexes along).
CREATE UNIQUE INDEX events_by_job ON events (job_id, version);
