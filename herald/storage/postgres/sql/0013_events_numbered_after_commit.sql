-- PostgreSQL migration 13: a tenant's events are numbered after they commit (issue 24).
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).
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

CREATE OR REPLACE FUNCTION herald_append_event(
    p_tenant TEXT, p_job_id TEXT, p_kind TEXT, p_version INTEGER, p_type TEXT, p_at DOUBLE PRECISION,
    p_data BYTEA, p_event_subject TEXT, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA,
    p_traceparent TEXT, p_tracestate TEXT
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    v_id BIGINT;
BEGIN
    -- No tenant-wide lock: the event is numbered after commit (herald_number_events).
    INSERT INTO events (tenant, job_id, kind, version, type, at, data)
    VALUES (p_tenant, p_job_id, p_kind, p_version, p_type, p_at, p_data)
    RETURNING id INTO v_id;
    -- The JobEvent's JSON without its {"seq":N, head (the client sent the rest); the job's
    -- trace context rides along: the relay sends it as the message's headers.
    INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate, event_id)
    VALUES (p_event_subject, 'ev.' || p_job_id || '.' || p_version, p_event_tail, {now},
            p_traceparent, p_tracestate, v_id);
    IF p_work_subject IS NOT NULL THEN
        INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate)
        VALUES (p_work_subject, p_work_msg_id, p_work_payload, {now}, p_traceparent, p_tracestate);
    END IF;
    RETURN 0;  -- committed, not numbered yet
END
$fn$;

-- Number the tenant's committed unnumbered events, in id order; how many it numbered.
CREATE OR REPLACE FUNCTION herald_number_events(p_tenant TEXT) RETURNS INTEGER LANGUAGE plpgsql AS $fn$
DECLARE
    v_last BIGINT;
    v_count INTEGER;
BEGIN
    INSERT INTO tenant_seq AS s (tenant, last) VALUES (p_tenant, 0) ON CONFLICT (tenant) DO NOTHING;
    -- Held to commit: the next pass of this tenant waits here for this one's numbers.
    SELECT s.last INTO v_last FROM tenant_seq s WHERE s.tenant = p_tenant FOR UPDATE;
    -- A statement of its own, so a snapshot taken after the lock: every event committed
    -- before now, and every number the previous pass gave, are seen.
    WITH todo AS (
        SELECT e.id, row_number() OVER (ORDER BY e.id) AS n
        FROM events e WHERE e.tenant = p_tenant AND e.seq IS NULL
    ), numbered AS (
        UPDATE events e SET seq = v_last + todo.n FROM todo WHERE e.id = todo.id RETURNING 1
    )
    SELECT count(*) INTO v_count FROM todo;  -- the UPDATE runs whether or not it is read
    IF v_count > 0 THEN
        -- A row retention deleted meanwhile leaves its number unused, as retention does anyway.
        UPDATE tenant_seq SET last = v_last + v_count WHERE tenant = p_tenant;
    END IF;
    RETURN v_count;
END
$fn$;

-- The relay's batch: the oldest unpublished rows this process committed (p_stale_s NULL),
-- or anyone's older than p_stale_s; their events numbered first, so every event row comes
-- with its complete JobEvent payload. Tenants are numbered in byte order, the order a group
-- commit takes tenants' rows in (Python's sort), so a pass and a capped claim's batch
-- cannot wait on each other's tenant rows in a cycle.
CREATE OR REPLACE FUNCTION herald_outbox_batch(p_origin TEXT, p_stale_s DOUBLE PRECISION, p_limit INTEGER)
RETURNS TABLE (seq BIGINT, subject TEXT, msg_id TEXT, payload BYTEA, traceparent TEXT, tracestate TEXT)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    v_batch BIGINT[];
    v_tenant TEXT;
BEGIN
    IF p_stale_s IS NULL THEN
        SELECT array_agg(b.seq) INTO v_batch FROM (
            SELECT o.seq FROM outbox o WHERE o.origin = p_origin ORDER BY o.seq LIMIT p_limit) b;
    ELSE
        SELECT array_agg(b.seq) INTO v_batch FROM (
            SELECT o.seq FROM outbox o WHERE o.created_at < {now} - p_stale_s ORDER BY o.seq LIMIT p_limit) b;
    END IF;
    IF v_batch IS NULL THEN
        RETURN;
    END IF;
    FOR v_tenant IN
        SELECT DISTINCT e.tenant COLLATE "C" FROM outbox o JOIN events e ON e.id = o.event_id
        WHERE o.seq = ANY (v_batch) AND e.seq IS NULL ORDER BY 1
    LOOP
        PERFORM herald_number_events(v_tenant);
    END LOOP;
    -- An event row whose event is not numbered (a row published and deleted meanwhile is
    -- simply gone) waits for the next batch.
    RETURN QUERY
        SELECT o.seq, o.subject, o.msg_id,
               CASE WHEN o.event_id IS NULL THEN o.payload
                    ELSE convert_to('{"seq":' || e.seq || ',', 'UTF8') || o.payload END,
               o.traceparent, o.tracestate
        FROM outbox o LEFT JOIN events e ON e.id = o.event_id
        WHERE o.seq = ANY (v_batch) AND (o.event_id IS NULL OR e.seq IS NOT NULL)
        ORDER BY o.seq;
END
$fn$;

-- SPEC §13's capped claim counts a tenant's running jobs under the tenant's tenant_seq row,
-- as before; the row now appears with the tenant's first numbering pass, so the claim makes
-- it if it is not there yet (a lock on a row that does not exist would be no lock).
CREATE OR REPLACE FUNCTION herald_claim_capped(
    p_max_running INTEGER,
    p_id TEXT, p_seen_version INTEGER, p_seen_updated_at DOUBLE PRECISION,
    p_state TEXT, p_progress INTEGER, p_attempt INTEGER, p_cancel_requested BOOLEAN,
    p_heartbeat_at DOUBLE PRECISION, p_error BYTEA, p_result_path TEXT, p_media_type TEXT,
    p_finished_at DOUBLE PRECISION, p_expires_at DOUBLE PRECISION, p_updated_at DOUBLE PRECISION,
    p_event_type TEXT, p_event_subject TEXT, p_event_data BYTEA, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    v_tenant TEXT;
    v_running BIGINT;
BEGIN
    SELECT j.tenant INTO v_tenant FROM jobs j WHERE j.id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO tenant_seq (tenant, last) VALUES (v_tenant, 0) ON CONFLICT (tenant) DO NOTHING;
    PERFORM 1 FROM tenant_seq s WHERE s.tenant = v_tenant FOR UPDATE;
    -- A new snapshot: every claim that held the lock before us has committed and is counted.
    SELECT count(*) INTO v_running FROM jobs j WHERE j.tenant = v_tenant AND j.state = 'running';
    IF v_running >= p_max_running THEN
        RETURN -1;
    END IF;
    RETURN herald_transition(p_id, p_seen_version, p_seen_updated_at, p_state, p_progress, p_attempt,
                             p_cancel_requested, p_heartbeat_at, p_error, p_result_path, p_media_type,
                             p_finished_at, p_expires_at, p_updated_at, p_event_type, p_event_subject,
                             p_event_data, p_event_tail, p_work_subject, p_work_msg_id, p_work_payload);
END
$fn$;
