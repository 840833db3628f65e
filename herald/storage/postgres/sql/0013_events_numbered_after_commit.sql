-- PostgreSQL migration 13: a tenant's events are numbered after they commit (issue 24).
--
-- Before: herald_append_event bumped the tenant's tenant_seq row and held its lock until
-- commit, WAL flush included, so one tenant's writes were one commit at a time however many
-- gateways and workers it had. Now a write takes no tenant-wide lock: its event row gets a
-- global identity (id, from a sequence: no lock held to commit) and no seq. The seq, the
-- tenant-wide position the feed and the tenant stream page by, is given after commit by a
-- numbering pass (herald_number_events, run by the relay before it publishes): under the
-- tenant's tenant_seq row, it numbers every committed unnumbered event of the tenant in id
-- order, gap-free after tenant_seq.last. Readers read numbered rows only, by seq, so:
--
-- * the order never changes once read: a row is numbered once, and every pass numbers
--   after the previous pass's last number (it waits for that pass's commit on the row);
-- * nothing is missed: an event committed late (its transaction held open while later ones
--   committed) is numbered by the first pass after its commit, after everything already
--   numbered; no reader has read past a number it was not given;
-- * a job's order is kept: version n+1 is written only after version n committed (the
--   compare-and-set reads n first), so its id is higher, and any pass that sees it sees n;
-- * commit order: a transaction that began after another committed has a higher id and is
--   seen by the same or a later pass; only transactions that overlapped may be numbered in
--   either order, as no reader could tell which committed first.

ALTER TABLE events ADD COLUMN id BIGINT GENERATED ALWAYS AS IDENTITY;
ALTER TABLE events DROP CONSTRAINT events_pkey;
ALTER TABLE events ALTER COLUMN seq DROP NOT NULL;
ALTER TABLE events ADD CONSTRAINT events_pkey PRIMARY KEY (id);
-- The feed's and the tenant stream's reads (seq > n implies a numbered row: the partial
-- index serves them, and an unnumbered row costs it no entry).
CREATE UNIQUE INDEX events_by_seq ON events (tenant, seq) WHERE seq IS NOT NULL;
-- What a numbering pass takes, in id order.
CREATE INDEX events_unnumbered ON events (tenant, id) WHERE seq IS NULL;

-- An event's outbox row names its event: the relay's batch prepends {"seq":N, to the
-- payload once the event is numbered.
ALTER TABLE outbox ADD COLUMN event_id BIGINT;

-- herald_append_event: its definition is functions/jobs_writes.sql now (repeatable: applied whenever it changes).

-- herald_number_events: its definition is functions/events_numbering.sql now (repeatable: applied whenever it changes).

-- herald_outbox_batch: its definition is functions/events_numbering.sql now (repeatable: applied whenever it changes).

-- herald_claim_capped: its definition is functions/jobs_writes.sql now (repeatable: applied whenever it changes).
