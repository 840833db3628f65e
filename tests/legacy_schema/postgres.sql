-- The PostgreSQL schema as Herald made it before herald/storage/migrations.py (main at
-- 3411d9e): every migration of that time, in its order, and its record of them.
-- tests/test_migrations.py upgrades a database made from this file.

-- ===== jobs-1
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    kind TEXT NOT NULL,
    collection TEXT NOT NULL,
    state TEXT NOT NULL,
    params BYTEA NOT NULL,
    progress INTEGER,
    version INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION,
    deadline_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION,
    expires_at DOUBLE PRECISION,
    result_path TEXT,
    media_type TEXT,
    error BYTEA,
    callback_url TEXT,
    traceparent TEXT,
    tracestate TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, created_at DESC, id DESC);
CREATE INDEX IF NOT EXISTS jobs_live ON jobs (state, heartbeat_at) WHERE state IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS jobs_queued_since ON jobs (created_at) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS jobs_expiring ON jobs (expires_at) WHERE expires_at IS NOT NULL;

CREATE TABLE IF NOT EXISTS events (
    tenant TEXT NOT NULL,
    seq BIGINT NOT NULL,
    job_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (tenant, seq)
);
CREATE UNIQUE INDEX IF NOT EXISTS events_by_job ON events (job_id, version);

CREATE TABLE IF NOT EXISTS tenant_seq (tenant TEXT PRIMARY KEY, last BIGINT NOT NULL);

CREATE TABLE IF NOT EXISTS outbox (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subject TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    payload BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    traceparent TEXT,
    tracestate TEXT
);

CREATE TABLE IF NOT EXISTS idempotency_keys (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    job_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS idempotency_expiring ON idempotency_keys (expires_at);
-- forget() deletes a job's keys by job id.
CREATE INDEX IF NOT EXISTS idempotency_by_job ON idempotency_keys (job_id);

CREATE TABLE IF NOT EXISTS tombstones (
    job_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    deleted_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE IF NOT EXISTS rate_buckets (
    tenant TEXT PRIMARY KEY,
    tokens DOUBLE PRECISION NOT NULL,
    at DOUBLE PRECISION NOT NULL
);

CREATE TABLE IF NOT EXISTS herald_secrets (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE OR REPLACE FUNCTION herald_append_event(
    p_tenant TEXT, p_job_id TEXT, p_kind TEXT, p_version INTEGER, p_type TEXT, p_at DOUBLE PRECISION,
    p_data BYTEA, p_event_subject TEXT, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA,
    p_traceparent TEXT, p_tracestate TEXT
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    v_seq BIGINT;
BEGIN
    -- The tenant's counter row stays locked until commit: seq n+1 is handed out only once
    -- n has committed (or rolled back, and then n is handed out again). Gap-free, and no
    -- reader sees a later seq before an earlier one.
    INSERT INTO tenant_seq AS s (tenant, last) VALUES (p_tenant, 1)
    ON CONFLICT (tenant) DO UPDATE SET last = s.last + 1
    RETURNING s.last INTO v_seq;
    INSERT INTO events (tenant, seq, job_id, kind, version, type, at, data)
    VALUES (p_tenant, v_seq, p_job_id, p_kind, p_version, p_type, p_at, p_data);
    -- The JobEvent's JSON begins with its seq: the client sent the rest.
    -- The job's trace context rides along: the relay sends it as the message's headers.
    INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate)
    VALUES (p_event_subject, 'ev.' || p_job_id || '.' || p_version,
            convert_to('{"seq":' || v_seq || ',', 'UTF8') || p_event_tail, extract(epoch from clock_timestamp())::double precision, p_traceparent, p_tracestate);
    IF p_work_subject IS NOT NULL THEN
        INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate)
        VALUES (p_work_subject, p_work_msg_id, p_work_payload, extract(epoch from clock_timestamp())::double precision, p_traceparent, p_tracestate);
    END IF;
    RETURN v_seq;
END
$fn$;

CREATE OR REPLACE FUNCTION herald_accept(
    p_id TEXT, p_tenant TEXT, p_kind TEXT, p_collection TEXT, p_params BYTEA, p_callback_url TEXT,
    p_ts DOUBLE PRECISION, p_deadline_s DOUBLE PRECISION,
    p_key TEXT, p_fingerprint TEXT, p_key_ttl_s DOUBLE PRECISION,
    p_rate DOUBLE PRECISION, p_burst DOUBLE PRECISION,
    p_event_subject TEXT, p_event_data BYTEA, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA,
    p_traceparent TEXT, p_tracestate TEXT,
    OUT outcome TEXT, OUT wait_s DOUBLE PRECISION, OUT event_seq BIGINT, OUT job jobs
) LANGUAGE plpgsql AS $fn$
DECLARE
    v_tokens DOUBLE PRECISION;
    v_at DOUBLE PRECISION;
    v_now DOUBLE PRECISION;
    v_key idempotency_keys;
    v_tries INTEGER := 0;
BEGIN
    -- 1. The start budget: judged now, spent only if the start succeeds (a mismatch spends nothing).
    IF p_rate IS NOT NULL THEN
        -- A tenant's first start creates its bucket full (as "no row" means); then the row is
        -- locked, so every gateway's starts of this tenant draw on it one at a time.
        INSERT INTO rate_buckets (tenant, tokens, at) VALUES (p_tenant, p_burst, extract(epoch from clock_timestamp())::double precision)
        ON CONFLICT (tenant) DO NOTHING;
        SELECT b.tokens, b.at INTO v_tokens, v_at FROM rate_buckets b WHERE b.tenant = p_tenant FOR UPDATE;
        v_now := extract(epoch from clock_timestamp())::double precision;  -- read under the lock: the bucket's times only move forward
        v_tokens := least(p_burst, v_tokens + greatest(0, v_now - v_at) * p_rate);
        IF v_tokens < 1 THEN
            outcome := 'limited';
            wait_s := CASE WHEN p_rate > 0 THEN (1 - v_tokens) / p_rate ELSE 'Infinity'::float8 END;
            RETURN;
        END IF;
    END IF;

    -- 2. The Idempotency-Key: claim it, or find who holds it.
    IF p_key IS NOT NULL THEN
        LOOP
            v_tries := v_tries + 1;
            IF v_tries > 10 THEN
                RAISE EXCEPTION 'Idempotency-Key % of tenant % keeps changing', p_key, p_tenant;
            END IF;
            -- A racing claim of the same key makes this wait for its commit, then do nothing.
            INSERT INTO idempotency_keys (tenant, key, fingerprint, job_id, created_at, expires_at)
            VALUES (p_tenant, p_key, p_fingerprint, p_id, p_ts, p_ts + p_key_ttl_s)
            ON CONFLICT (tenant, key) DO NOTHING;
            EXIT WHEN FOUND;  -- the key is ours: a new job
            SELECT * INTO v_key FROM idempotency_keys k WHERE k.tenant = p_tenant AND k.key = p_key FOR UPDATE;
            CONTINUE WHEN NOT FOUND;  -- deleted meanwhile (retention): claim it again
            IF v_key.expires_at <= p_ts THEN
                DELETE FROM idempotency_keys k WHERE k.tenant = p_tenant AND k.key = p_key;
                CONTINUE;
            END IF;
            IF v_key.fingerprint <> p_fingerprint THEN
                outcome := 'mismatch';  -- nothing written: the claim conflicted, the token is unspent
                RETURN;
            END IF;
            SELECT * INTO job FROM jobs j WHERE j.id = v_key.job_id;
            IF FOUND THEN
                IF p_rate IS NOT NULL THEN  -- replays count against the budget (SPEC 10)
                    UPDATE rate_buckets SET tokens = v_tokens - 1, at = v_now WHERE tenant = p_tenant;
                END IF;
                outcome := 'replayed';
                RETURN;
            END IF;
            -- The job is gone (retention) but the key lives on: answer as if new.
            DELETE FROM idempotency_keys k WHERE k.tenant = p_tenant AND k.key = p_key;
        END LOOP;
    END IF;

    -- 3. The job, queued at version 1, its first event and its work message.
    IF p_rate IS NOT NULL THEN
        UPDATE rate_buckets SET tokens = v_tokens - 1, at = v_now WHERE tenant = p_tenant;
    END IF;
    INSERT INTO jobs (id, tenant, kind, collection, state, params, progress, version, attempt,
                      created_at, updated_at, deadline_at, callback_url, traceparent, tracestate)
    VALUES (p_id, p_tenant, p_kind, p_collection, 'queued', p_params, NULL, 1, 0,
            p_ts, p_ts, p_ts + p_deadline_s, p_callback_url, p_traceparent, p_tracestate)
    RETURNING * INTO job;
    event_seq := herald_append_event(p_tenant, p_id, p_kind, 1, 'job.queued', p_ts, p_event_data,
                                     p_event_subject, p_event_tail, p_work_subject, p_work_msg_id, p_work_payload,
                                     p_traceparent, p_tracestate);
    outcome := 'accepted';
END
$fn$;

CREATE OR REPLACE FUNCTION herald_transition(
    p_id TEXT, p_seen_version INTEGER, p_seen_updated_at DOUBLE PRECISION,
    p_state TEXT, p_progress INTEGER, p_attempt INTEGER, p_cancel_requested BOOLEAN,
    p_heartbeat_at DOUBLE PRECISION, p_error BYTEA, p_result_path TEXT, p_media_type TEXT,
    p_finished_at DOUBLE PRECISION, p_expires_at DOUBLE PRECISION, p_updated_at DOUBLE PRECISION,
    p_event_type TEXT, p_event_subject TEXT, p_event_data BYTEA, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    v_tenant TEXT;
    v_kind TEXT;
    v_traceparent TEXT;
    v_tracestate TEXT;
BEGIN
    -- Compare-and-set: only the row the client judged. Heartbeats move updated_at (not
    -- version), so both are compared. NULL: it moved; the client reads and judges again.
    UPDATE jobs j SET
        state = p_state, progress = p_progress, attempt = p_attempt, cancel_requested = p_cancel_requested,
        heartbeat_at = p_heartbeat_at, error = p_error, result_path = p_result_path, media_type = p_media_type,
        finished_at = p_finished_at, expires_at = p_expires_at, updated_at = p_updated_at,
        version = p_seen_version + 1
    WHERE j.id = p_id AND j.version = p_seen_version AND j.updated_at = p_seen_updated_at
    RETURNING j.tenant, j.kind, j.traceparent, j.tracestate INTO v_tenant, v_kind, v_traceparent, v_tracestate;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN herald_append_event(v_tenant, p_id, v_kind, p_seen_version + 1, p_event_type, p_updated_at, p_event_data,
                               p_event_subject, p_event_tail, p_work_subject, p_work_msg_id, p_work_payload,
                               v_traceparent, v_tracestate);
END
$fn$;

-- ===== jobs-trace-context
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS traceparent TEXT, ADD COLUMN IF NOT EXISTS tracestate TEXT;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS traceparent TEXT, ADD COLUMN IF NOT EXISTS tracestate TEXT;
DROP FUNCTION IF EXISTS herald_accept(TEXT, TEXT, TEXT, TEXT, BYTEA, TEXT, DOUBLE PRECISION, DOUBLE PRECISION,
    TEXT, TEXT, DOUBLE PRECISION, DOUBLE PRECISION, DOUBLE PRECISION, TEXT, BYTEA, BYTEA, TEXT, TEXT, BYTEA);
DROP FUNCTION IF EXISTS herald_append_event(TEXT, TEXT, TEXT, INTEGER, TEXT, DOUBLE PRECISION, BYTEA, TEXT, BYTEA,
    TEXT, TEXT, BYTEA);

CREATE OR REPLACE FUNCTION herald_append_event(
    p_tenant TEXT, p_job_id TEXT, p_kind TEXT, p_version INTEGER, p_type TEXT, p_at DOUBLE PRECISION,
    p_data BYTEA, p_event_subject TEXT, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA,
    p_traceparent TEXT, p_tracestate TEXT
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    v_seq BIGINT;
BEGIN
    -- The tenant's counter row stays locked until commit: seq n+1 is handed out only once
    -- n has committed (or rolled back, and then n is handed out again). Gap-free, and no
    -- reader sees a later seq before an earlier one.
    INSERT INTO tenant_seq AS s (tenant, last) VALUES (p_tenant, 1)
    ON CONFLICT (tenant) DO UPDATE SET last = s.last + 1
    RETURNING s.last INTO v_seq;
    INSERT INTO events (tenant, seq, job_id, kind, version, type, at, data)
    VALUES (p_tenant, v_seq, p_job_id, p_kind, p_version, p_type, p_at, p_data);
    -- The JobEvent's JSON begins with its seq: the client sent the rest.
    -- The job's trace context rides along: the relay sends it as the message's headers.
    INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate)
    VALUES (p_event_subject, 'ev.' || p_job_id || '.' || p_version,
            convert_to('{"seq":' || v_seq || ',', 'UTF8') || p_event_tail, extract(epoch from clock_timestamp())::double precision, p_traceparent, p_tracestate);
    IF p_work_subject IS NOT NULL THEN
        INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate)
        VALUES (p_work_subject, p_work_msg_id, p_work_payload, extract(epoch from clock_timestamp())::double precision, p_traceparent, p_tracestate);
    END IF;
    RETURN v_seq;
END
$fn$;

CREATE OR REPLACE FUNCTION herald_accept(
    p_id TEXT, p_tenant TEXT, p_kind TEXT, p_collection TEXT, p_params BYTEA, p_callback_url TEXT,
    p_ts DOUBLE PRECISION, p_deadline_s DOUBLE PRECISION,
    p_key TEXT, p_fingerprint TEXT, p_key_ttl_s DOUBLE PRECISION,
    p_rate DOUBLE PRECISION, p_burst DOUBLE PRECISION,
    p_event_subject TEXT, p_event_data BYTEA, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA,
    p_traceparent TEXT, p_tracestate TEXT,
    OUT outcome TEXT, OUT wait_s DOUBLE PRECISION, OUT event_seq BIGINT, OUT job jobs
) LANGUAGE plpgsql AS $fn$
DECLARE
    v_tokens DOUBLE PRECISION;
    v_at DOUBLE PRECISION;
    v_now DOUBLE PRECISION;
    v_key idempotency_keys;
    v_tries INTEGER := 0;
BEGIN
    -- 1. The start budget: judged now, spent only if the start succeeds (a mismatch spends nothing).
    IF p_rate IS NOT NULL THEN
        -- A tenant's first start creates its bucket full (as "no row" means); then the row is
        -- locked, so every gateway's starts of this tenant draw on it one at a time.
        INSERT INTO rate_buckets (tenant, tokens, at) VALUES (p_tenant, p_burst, extract(epoch from clock_timestamp())::double precision)
        ON CONFLICT (tenant) DO NOTHING;
        SELECT b.tokens, b.at INTO v_tokens, v_at FROM rate_buckets b WHERE b.tenant = p_tenant FOR UPDATE;
        v_now := extract(epoch from clock_timestamp())::double precision;  -- read under the lock: the bucket's times only move forward
        v_tokens := least(p_burst, v_tokens + greatest(0, v_now - v_at) * p_rate);
        IF v_tokens < 1 THEN
            outcome := 'limited';
            wait_s := CASE WHEN p_rate > 0 THEN (1 - v_tokens) / p_rate ELSE 'Infinity'::float8 END;
            RETURN;
        END IF;
    END IF;

    -- 2. The Idempotency-Key: claim it, or find who holds it.
    IF p_key IS NOT NULL THEN
        LOOP
            v_tries := v_tries + 1;
            IF v_tries > 10 THEN
                RAISE EXCEPTION 'Idempotency-Key % of tenant % keeps changing', p_key, p_tenant;
            END IF;
            -- A racing claim of the same key makes this wait for its commit, then do nothing.
            INSERT INTO idempotency_keys (tenant, key, fingerprint, job_id, created_at, expires_at)
            VALUES (p_tenant, p_key, p_fingerprint, p_id, p_ts, p_ts + p_key_ttl_s)
            ON CONFLICT (tenant, key) DO NOTHING;
            EXIT WHEN FOUND;  -- the key is ours: a new job
            SELECT * INTO v_key FROM idempotency_keys k WHERE k.tenant = p_tenant AND k.key = p_key FOR UPDATE;
            CONTINUE WHEN NOT FOUND;  -- deleted meanwhile (retention): claim it again
            IF v_key.expires_at <= p_ts THEN
                DELETE FROM idempotency_keys k WHERE k.tenant = p_tenant AND k.key = p_key;
                CONTINUE;
            END IF;
            IF v_key.fingerprint <> p_fingerprint THEN
                outcome := 'mismatch';  -- nothing written: the claim conflicted, the token is unspent
                RETURN;
            END IF;
            SELECT * INTO job FROM jobs j WHERE j.id = v_key.job_id;
            IF FOUND THEN
                IF p_rate IS NOT NULL THEN  -- replays count against the budget (SPEC 10)
                    UPDATE rate_buckets SET tokens = v_tokens - 1, at = v_now WHERE tenant = p_tenant;
                END IF;
                outcome := 'replayed';
                RETURN;
            END IF;
            -- The job is gone (retention) but the key lives on: answer as if new.
            DELETE FROM idempotency_keys k WHERE k.tenant = p_tenant AND k.key = p_key;
        END LOOP;
    END IF;

    -- 3. The job, queued at version 1, its first event and its work message.
    IF p_rate IS NOT NULL THEN
        UPDATE rate_buckets SET tokens = v_tokens - 1, at = v_now WHERE tenant = p_tenant;
    END IF;
    INSERT INTO jobs (id, tenant, kind, collection, state, params, progress, version, attempt,
                      created_at, updated_at, deadline_at, callback_url, traceparent, tracestate)
    VALUES (p_id, p_tenant, p_kind, p_collection, 'queued', p_params, NULL, 1, 0,
            p_ts, p_ts, p_ts + p_deadline_s, p_callback_url, p_traceparent, p_tracestate)
    RETURNING * INTO job;
    event_seq := herald_append_event(p_tenant, p_id, p_kind, 1, 'job.queued', p_ts, p_event_data,
                                     p_event_subject, p_event_tail, p_work_subject, p_work_msg_id, p_work_payload,
                                     p_traceparent, p_tracestate);
    outcome := 'accepted';
END
$fn$;

CREATE OR REPLACE FUNCTION herald_transition(
    p_id TEXT, p_seen_version INTEGER, p_seen_updated_at DOUBLE PRECISION,
    p_state TEXT, p_progress INTEGER, p_attempt INTEGER, p_cancel_requested BOOLEAN,
    p_heartbeat_at DOUBLE PRECISION, p_error BYTEA, p_result_path TEXT, p_media_type TEXT,
    p_finished_at DOUBLE PRECISION, p_expires_at DOUBLE PRECISION, p_updated_at DOUBLE PRECISION,
    p_event_type TEXT, p_event_subject TEXT, p_event_data BYTEA, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    v_tenant TEXT;
    v_kind TEXT;
    v_traceparent TEXT;
    v_tracestate TEXT;
BEGIN
    -- Compare-and-set: only the row the client judged. Heartbeats move updated_at (not
    -- version), so both are compared. NULL: it moved; the client reads and judges again.
    UPDATE jobs j SET
        state = p_state, progress = p_progress, attempt = p_attempt, cancel_requested = p_cancel_requested,
        heartbeat_at = p_heartbeat_at, error = p_error, result_path = p_result_path, media_type = p_media_type,
        finished_at = p_finished_at, expires_at = p_expires_at, updated_at = p_updated_at,
        version = p_seen_version + 1
    WHERE j.id = p_id AND j.version = p_seen_version AND j.updated_at = p_seen_updated_at
    RETURNING j.tenant, j.kind, j.traceparent, j.tracestate INTO v_tenant, v_kind, v_traceparent, v_tracestate;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN herald_append_event(v_tenant, p_id, v_kind, p_seen_version + 1, p_event_type, p_updated_at, p_event_data,
                               p_event_subject, p_event_tail, p_work_subject, p_work_msg_id, p_work_payload,
                               v_traceparent, v_tracestate);
END
$fn$;

-- ===== jobs-queued-by-kind
CREATE INDEX IF NOT EXISTS jobs_queued_by_kind ON jobs (kind, created_at) WHERE state = 'queued';

-- ===== outbox-origin
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS origin TEXT DEFAULT current_setting('herald.origin', true);

-- ===== jobs-tenant-fair-share
CREATE INDEX IF NOT EXISTS jobs_running_by_tenant ON jobs (tenant) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS jobs_queued_by_tenant ON jobs (kind, tenant, created_at) WHERE state = 'queued';

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

-- ===== jobs-events-numbered-after-commit
-- PostgreSQL migration 13: a tenant's events are numbered after they commit (issue 24).
-- The names in braces are filled in when it is applied (herald/storage/postgres/jobs.py).
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
    VALUES (p_event_subject, 'ev.' || p_job_id || '.' || p_version, p_event_tail, extract(epoch from clock_timestamp())::double precision,
            p_traceparent, p_tracestate, v_id);
    IF p_work_subject IS NOT NULL THEN
        INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate)
        VALUES (p_work_subject, p_work_msg_id, p_work_payload, extract(epoch from clock_timestamp())::double precision, p_traceparent, p_tracestate);
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
            SELECT o.seq FROM outbox o WHERE o.created_at < extract(epoch from clock_timestamp())::double precision - p_stale_s ORDER BY o.seq LIMIT p_limit) b;
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

-- ===== webhooks-1-tables
-- PostgreSQL migration 6: the webhook tables (endpoints, keys, messages, deliveries, attempts).

CREATE TABLE webhook_endpoints (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    url TEXT NOT NULL,
    event_types TEXT[] NOT NULL,
    kinds TEXT[],
    signature TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    failing_since DOUBLE PRECISION
);
CREATE INDEX webhook_endpoints_by_tenant ON webhook_endpoints (tenant, created_at DESC, id DESC);

CREATE TABLE webhook_keys (
    owner TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    algorithm TEXT NOT NULL,
    secret BYTEA NOT NULL,
    public_key BYTEA,
    retire_at DOUBLE PRECISION,
    PRIMARY KEY (owner, created_at)
);
-- At most one current key per owner, whatever races.
CREATE UNIQUE INDEX webhook_keys_current ON webhook_keys (owner) WHERE retire_at IS NULL;

CREATE TABLE webhook_messages (
    event_id TEXT PRIMARY KEY,
    body BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE webhook_deliveries (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    target TEXT NOT NULL,
    endpoint_id TEXT,
    url TEXT,
    event_id TEXT NOT NULL,
    job_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    scheduled_at DOUBLE PRECISION NOT NULL,
    next_attempt_at DOUBLE PRECISION,
    lease_owner TEXT,
    lease_until DOUBLE PRECISION,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    -- event_id first: the idempotency key of fan-out and the probe of message pruning
    UNIQUE (event_id, target)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
-- One job's deliveries to one target: superseding, progress throttling, finish.
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (target, job_id, version);
-- The claim's ordering rule looks only at what is pending, per target and job.
CREATE INDEX webhook_deliveries_pending_order ON webhook_deliveries (target, job_id, version)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_endpoint ON webhook_deliveries (endpoint_id, seq);
CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (updated_at) WHERE status <> 'pending';

CREATE TABLE webhook_attempts (
    delivery_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    status_code INTEGER,
    latency_ms DOUBLE PRECISION,
    error TEXT,
    response BYTEA,
    PRIMARY KEY (delivery_id, n)
);

-- ===== webhooks-1-functions
-- PostgreSQL migration 7: the webhook functions (keys, fan-out, claim, finish).
-- The names in braces are filled in when it is applied (herald/storage/postgres/webhooks.py).

-- A new current key; the previous current one signs for the overlap, then retires.
CREATE FUNCTION herald_webhook_add_key(
    p_owner TEXT, p_algorithm TEXT, p_secret BYTEA, p_public_key BYTEA, p_overlap DOUBLE PRECISION
) RETURNS VOID LANGUAGE plpgsql AS $$
DECLARE
    ts DOUBLE PRECISION;
    latest DOUBLE PRECISION;
BEGIN
    PERFORM pg_advisory_xact_lock(1464355673, hashtext(p_owner));
    ts := extract(epoch from clock_timestamp())::double precision;
    DELETE FROM webhook_keys k WHERE k.owner = p_owner AND k.retire_at IS NOT NULL AND k.retire_at <= ts;
    UPDATE webhook_keys k SET retire_at = ts + p_overlap WHERE k.owner = p_owner AND k.retire_at IS NULL;
    SELECT max(k.created_at) INTO latest FROM webhook_keys k WHERE k.owner = p_owner;
    INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)
    -- the key's primary key must move forward
    VALUES (p_owner, greatest(ts, coalesce(latest + 1e-6, ts)), p_algorithm, p_secret, p_public_key);
END $$;

-- The owner's current key; the given one becomes it if there is none (first use).
CREATE FUNCTION herald_webhook_ensure_key(
    p_owner TEXT, p_algorithm TEXT, p_secret BYTEA, p_public_key BYTEA
) RETURNS TABLE (algorithm TEXT, secret BYTEA, public_key BYTEA) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(1464355673, hashtext(p_owner));
    RETURN QUERY SELECT k.algorithm, k.secret, k.public_key FROM webhook_keys k
        WHERE k.owner = p_owner AND k.retire_at IS NULL;
    IF FOUND THEN
        RETURN;
    END IF;
    INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)
    VALUES (p_owner, extract(epoch from clock_timestamp())::double precision, p_algorithm, p_secret, p_public_key);
    RETURN QUERY SELECT p_algorithm, p_secret, p_public_key;
END $$;

-- notifier.queue's fan_out and _add_delivery, statement for statement, after the locks.
CREATE FUNCTION herald_webhook_fan_out(
    p_tenants TEXT[], p_job_ids TEXT[], p_versions INTEGER[], p_types TEXT[], p_kinds TEXT[],
    p_event_ids TEXT[], p_bodies BYTEA[], p_progress_interval DOUBLE PRECISION
) RETURNS INTEGER LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION;
    t_ords INTEGER[];
    t_targets TEXT[];
    t_endpoints TEXT[];
    t_urls TEXT[];
    done TEXT[];
    lock_key INTEGER;
    i INTEGER;
    o INTEGER;
    tgt TEXT;
    eid TEXT;
    job TEXT;
    ver INTEGER;
    typ TEXT;
    newer_sent BOOLEAN;
    last_progress DOUBLE PRECISION;
    new_status TEXT;
    due DOUBLE PRECISION;
    pending INTEGER := 0;
BEGIN
    -- Endpoints that take part are held against deletion and API disabling until commit
    -- (those take the row FOR UPDATE first); routine updates do not wait for this lock.
    PERFORM 1 FROM webhook_endpoints e
        WHERE e.tenant = ANY(p_tenants) AND e.status = 'enabled' ORDER BY e.id FOR KEY SHARE;

    -- Every receiver of every event: matching enabled endpoints, then the job's callback
    -- URL (read from the job's row, never copied into the event stream).
    SELECT coalesce(array_agg(r.ord ORDER BY r.ord, r.cb, r.target), '{}'),
           coalesce(array_agg(r.target ORDER BY r.ord, r.cb, r.target), '{}'),
           coalesce(array_agg(r.endpoint_id ORDER BY r.ord, r.cb, r.target), '{}'),
           coalesce(array_agg(r.url ORDER BY r.ord, r.cb, r.target), '{}')
      INTO t_ords, t_targets, t_endpoints, t_urls
      FROM (
        SELECT ev.ord::INTEGER AS ord, e.id AS target, e.id AS endpoint_id, NULL::TEXT AS url, 0 AS cb
          FROM unnest(p_tenants, p_types, p_kinds) WITH ORDINALITY AS ev(tenant, type, kind, ord)
          JOIN webhook_endpoints e
            ON e.tenant = ev.tenant AND e.status = 'enabled' AND ev.type = ANY(e.event_types)
           AND (e.kinds IS NULL OR ev.kind = ANY(e.kinds))
        UNION ALL
        SELECT ev.ord::INTEGER, 'callback:' || j.callback_url, NULL, j.callback_url, 1
          FROM unnest(p_job_ids, p_types) WITH ORDINALITY AS ev(job_id, type, ord)
          JOIN jobs j ON j.id = ev.job_id
         WHERE ev.type <> 'job.progress' AND j.callback_url IS NOT NULL AND j.callback_url <> ''
      ) r;
    IF cardinality(t_ords) = 0 THEN
        RETURN 0;
    END IF;

    -- One job's deliveries to one target are decided by one fan-out (or finish) at a time.
    -- Sorted, so that two fan-outs sharing keys cannot deadlock.
    FOR lock_key IN
        SELECT DISTINCT hashtext(x.target || chr(10) || p_job_ids[x.ord])
          FROM unnest(t_targets, t_ords) AS x(target, ord) ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(1464356690, lock_key);
    END LOOP;
    ts := extract(epoch from clock_timestamp())::double precision;

    -- The body once per event. A redelivered old event refreshes created_at, so pruning
    -- (which re-checks it under the row lock) cannot drop a body it is about to need.
    INSERT INTO webhook_messages (event_id, body, created_at)
    SELECT DISTINCT ON (p_event_ids[x.ord]) p_event_ids[x.ord], p_bodies[x.ord], ts
      FROM unnest(t_ords) AS x(ord) ORDER BY p_event_ids[x.ord]
    ON CONFLICT (event_id) DO UPDATE SET created_at = EXCLUDED.created_at;

    -- What was fanned out before (a redelivery), read once for the batch, after the locks.
    SELECT coalesce(array_agg(d.event_id || chr(10) || d.target), '{}') INTO done
      FROM webhook_deliveries d WHERE d.event_id = ANY(p_event_ids);

    FOR i IN 1 .. cardinality(t_ords) LOOP
        o := t_ords[i];
        tgt := t_targets[i];
        eid := p_event_ids[o];
        job := p_job_ids[o];
        ver := p_versions[o];
        typ := p_types[o];
        -- A redelivered NATS message: already fanned out.
        CONTINUE WHEN eid || chr(10) || tgt = ANY(done);
        -- A newer event of this job can reach us first. If a newer delivery was already
        -- sent or is being sent, this one would go back in time; otherwise it goes first.
        -- The newer rows are locked, so that no claim can lease one while we decide.
        SELECT coalesce(bool_or(n.attempts > 0 OR n.lease_until > ts), FALSE) INTO newer_sent
          FROM (SELECT d.attempts, d.lease_until FROM webhook_deliveries d
                 WHERE d.target = tgt AND d.job_id = job AND d.version > ver
                   FOR UPDATE) n;
        new_status := 'pending';
        due := ts;
        IF newer_sent THEN
            new_status := 'superseded';
        ELSE
            -- Older deliveries waiting for a retry (or a progress slot) say less than this one.
            UPDATE webhook_deliveries d SET status = 'superseded', next_attempt_at = NULL, updated_at = ts
             WHERE d.target = tgt AND d.job_id = job AND d.version < ver
               AND d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
               AND (d.attempts > 0 OR d.type = 'job.progress');
            IF typ = 'job.progress' THEN
                SELECT max(d.scheduled_at) INTO last_progress FROM webhook_deliveries d
                 WHERE d.target = tgt AND d.job_id = job AND d.type = 'job.progress'
                   AND (d.status <> 'superseded' OR d.attempts > 0);  -- sent, or to be
                IF last_progress IS NOT NULL THEN
                    due := greatest(ts, last_progress + p_progress_interval);
                END IF;
            END IF;
        END IF;
        INSERT INTO webhook_deliveries (id, tenant, target, endpoint_id, url, event_id, job_id, version, type,
                                        status, scheduled_at, next_attempt_at, created_at, updated_at)
        VALUES (gen_random_uuid()::TEXT, p_tenants[o], tgt, t_endpoints[i], t_urls[i], eid, job, ver, typ,
                new_status, due, CASE WHEN new_status = 'pending' THEN due END, ts, ts)
        ON CONFLICT (event_id, target) DO NOTHING;
        IF FOUND AND new_status = 'pending' THEN
            pending := pending + 1;
        END IF;
    END LOOP;
    RETURN pending;
END $$;

-- notifier.queue's first claim (a window over everything pending); migration 9 replaces it
-- with the claim per target.
CREATE FUNCTION herald_webhook_claim(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[])
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION := extract(epoch from clock_timestamp())::double precision;
    ids TEXT[];
BEGIN
    -- Candidates as in SQLite: due, unleased, endpoint enabled, a slot left for the target
    -- in this notifier (p_busy_*: what it has in flight), oldest first, and nothing whose
    -- older version of the same job is pending for the same target. The window query
    -- cannot take row locks, so the outer step locks; rows another notifier holds are
    -- skipped, rows it leased meanwhile are re-checked on their newest version.
    SELECT coalesce(array_agg(locked.id), '{}') INTO ids FROM (
        SELECT d.id
          FROM webhook_deliveries d
          JOIN (
            SELECT cand.id, cand.next_attempt_at, cand.seq, coalesce(b.n, 0) AS busy,
                   row_number() OVER (PARTITION BY cand.target ORDER BY cand.next_attempt_at, cand.seq) AS rank
              FROM webhook_deliveries cand
              JOIN webhook_messages m ON m.event_id = cand.event_id
              LEFT JOIN webhook_endpoints e ON e.id = cand.endpoint_id
              LEFT JOIN unnest(p_busy_targets, p_busy_counts) AS b(target, n) ON b.target = cand.target
             WHERE cand.status = 'pending' AND cand.next_attempt_at <= ts
               AND (cand.lease_until IS NULL OR cand.lease_until <= ts)
               AND (cand.endpoint_id IS NULL OR e.status = 'enabled')
               AND coalesce(b.n, 0) < p_per_target
               AND NOT EXISTS (
                   SELECT 1 FROM webhook_deliveries older
                    WHERE older.target = cand.target AND older.job_id = cand.job_id
                      AND older.status = 'pending' AND older.version < cand.version)
          ) c ON c.id = d.id
         WHERE c.rank <= p_per_target - c.busy
           AND d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
         ORDER BY c.next_attempt_at, c.seq
         -- LIMIT above the row locks: rows another notifier holds are passed over and the
         -- next candidates taken, so concurrent claims split the work instead of colliding.
         LIMIT p_limit
           FOR UPDATE OF d SKIP LOCKED
    ) locked;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;

    -- A new snapshot: an older version committed by a fan-out since the candidates were
    -- read holds its newer one back (fan-out locked the newer row while deciding, so it
    -- either finished before our lock or will see our lease and supersede itself).
    RETURN QUERY
    WITH leased AS (
        UPDATE webhook_deliveries d SET lease_owner = p_owner, lease_until = ts + p_lease_s
         WHERE d.id = ANY(ids)
           AND NOT EXISTS (
               SELECT 1 FROM webhook_deliveries older
                WHERE older.target = d.target AND older.job_id = d.job_id
                  AND older.status = 'pending' AND older.version < d.version)
        RETURNING d
    )
    SELECT l.d, coalesce(e.url, (l.d).url), m.body, k.algorithms, k.secrets, k.public_keys
      FROM leased l
      JOIN webhook_messages m ON m.event_id = (l.d).event_id
      LEFT JOIN webhook_endpoints e ON e.id = (l.d).endpoint_id
     CROSS JOIN LATERAL (
        -- the keys that sign now: the current one first, then any in their overlap
        SELECT array_agg(wk.algorithm ORDER BY wk.created_at DESC) AS algorithms,
               array_agg(wk.secret ORDER BY wk.created_at DESC) AS secrets,
               array_agg(wk.public_key ORDER BY wk.created_at DESC) AS public_keys
          FROM webhook_keys wk
         WHERE wk.owner = coalesce((l.d).endpoint_id, 'callback:' || (l.d).tenant)
           AND (wk.retire_at IS NULL OR wk.retire_at > ts)
     ) k
     ORDER BY (l.d).next_attempt_at, (l.d).seq;
END $$;

-- notifier.queue's finish, _status_after and _endpoint_health in one transaction.
CREATE FUNCTION herald_webhook_finish(
    p_id TEXT, p_target TEXT, p_job_id TEXT, p_owner TEXT, p_started_at DOUBLE PRECISION,
    p_status_code INTEGER, p_latency_ms DOUBLE PRECISION, p_error TEXT, p_response BYTEA, p_ok BOOLEAN,
    p_plan TEXT, p_delay_s DOUBLE PRECISION, p_gone BOOLEAN, p_disable_after DOUBLE PRECISION,
    OUT o_status TEXT, OUT o_next_attempt_at DOUBLE PRECISION, OUT o_endpoint_disabled BOOLEAN
) LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION;
    d webhook_deliveries;
    n INTEGER;
    e_status TEXT;
    e_failing DOUBLE PRECISION;
BEGIN
    -- In turn with fan-outs of this job and target (the "newer version" check below) and
    -- with another finish of the same delivery (attempt numbers).
    PERFORM pg_advisory_xact_lock(1464356690, hashtext(p_target || chr(10) || p_job_id));
    ts := extract(epoch from clock_timestamp())::double precision;
    o_endpoint_disabled := FALSE;
    SELECT * INTO d FROM webhook_deliveries WHERE id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        o_status := 'dropped';  -- its endpoint was deleted meanwhile
        RETURN;
    END IF;
    SELECT coalesce(max(a.n), 0) + 1 INTO n FROM webhook_attempts a WHERE a.delivery_id = p_id;
    INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response)
    VALUES (p_id, n, p_started_at, p_status_code, p_latency_ms, p_error, p_response);

    IF p_plan = 'delivered' OR p_plan = 'failed' THEN
        o_status := p_plan;
    ELSIF EXISTS (SELECT 1 FROM webhook_deliveries x
                   WHERE x.target = d.target AND x.job_id = d.job_id AND x.version > d.version) THEN
        o_status := 'superseded';  -- the newer one carries the whole status: no need to retry this one
    ELSE
        o_status := 'pending';
        o_next_attempt_at := ts + p_delay_s;
    END IF;

    -- Endpoint health: continuous failure is tracked; 410 or 5 days of it disables.
    IF d.endpoint_id IS NOT NULL THEN
        IF p_ok THEN
            UPDATE webhook_endpoints SET failing_since = NULL WHERE id = d.endpoint_id AND failing_since IS NOT NULL;
        ELSE
            UPDATE webhook_endpoints SET failing_since = coalesce(failing_since, ts) WHERE id = d.endpoint_id
            RETURNING status, failing_since INTO e_status, e_failing;
            IF FOUND AND e_status <> 'enabled' THEN
                o_endpoint_disabled := TRUE;
            ELSIF FOUND AND (p_gone OR ts - e_failing >= p_disable_after) THEN
                -- As the API's disable does: FOR UPDATE waits for fan-outs holding the endpoint
                -- (FOR KEY SHARE), so the failing below, a new snapshot, sees what they queued.
                PERFORM 1 FROM webhook_endpoints WHERE id = d.endpoint_id FOR UPDATE;
                UPDATE webhook_endpoints SET status = 'disabled', updated_at = ts WHERE id = d.endpoint_id;
                -- its waiting deliveries end failed; this one is settled just below, with its attempt count
                UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
                       lease_until = NULL, updated_at = ts
                 WHERE endpoint_id = d.endpoint_id AND status = 'pending' AND id <> p_id;
                o_endpoint_disabled := TRUE;
            END IF;
        END IF;
        IF o_endpoint_disabled AND o_status = 'pending' THEN
            o_status := 'failed';
            o_next_attempt_at := NULL;
        END IF;
    END IF;

    UPDATE webhook_deliveries SET status = o_status, attempts = n, next_attempt_at = o_next_attempt_at,
           lease_owner = NULL, lease_until = NULL, updated_at = ts
     WHERE id = p_id AND lease_owner = p_owner;
END $$;

-- ===== webhooks-2-finish-many
-- PostgreSQL migration 8: herald_webhook_finish_many.
-- The names in braces are filled in when it is applied (herald/storage/postgres/webhooks.py).

-- Several attempts recorded in one transaction, one round trip: herald_webhook_finish for
-- each, in the caller's order. The order locks of the whole batch are taken first and
-- sorted, as fan-out takes its own, so a batch and a fan-out cannot deadlock on them.
CREATE FUNCTION herald_webhook_finish_many(
    p_ids TEXT[], p_targets TEXT[], p_job_ids TEXT[], p_owner TEXT, p_started_at DOUBLE PRECISION[],
    p_status_codes INTEGER[], p_latency_ms DOUBLE PRECISION[], p_errors TEXT[], p_responses BYTEA[],
    p_ok BOOLEAN[], p_plans TEXT[], p_delays_s DOUBLE PRECISION[], p_gone BOOLEAN[],
    p_disable_after DOUBLE PRECISION
) RETURNS TABLE (o_ord INTEGER, o_status TEXT, o_next_attempt_at DOUBLE PRECISION, o_endpoint_disabled BOOLEAN)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    lock_key INTEGER;
    i INTEGER;
    f RECORD;
    ts DOUBLE PRECISION;
    fast INTEGER[];
BEGIN
    FOR lock_key IN
        SELECT DISTINCT hashtext(x.target || chr(10) || x.job_id)
          FROM unnest(p_targets, p_job_ids) AS x(target, job_id) ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(1464356690, lock_key);
    END LOOP;
    ts := extract(epoch from clock_timestamp())::double precision;

    -- The common case set-based: a 2xx answer (delivered), each delivery once in the batch.
    -- What herald_webhook_finish does for one such attempt (lock the row, number and log the
    -- attempt, settle the delivery, end its endpoint's failing streak), for all of them in
    -- a few statements instead of seven per attempt.
    SELECT coalesce(array_agg(x.ord::INTEGER ORDER BY x.ord), '{}') INTO fast
      FROM unnest(p_ids, p_ok, p_plans) WITH ORDINALITY AS x(id, ok, plan, ord)
     WHERE x.ok AND x.plan = 'delivered'
       AND x.id IN (SELECT y.id FROM unnest(p_ids) AS y(id) GROUP BY y.id HAVING count(*) = 1);
    IF cardinality(fast) > 0 THEN
        PERFORM 1 FROM webhook_deliveries d
         WHERE d.id IN (SELECT p_ids[o] FROM unnest(fast) AS o) ORDER BY d.id FOR UPDATE;
        RETURN QUERY
        WITH fx AS (
            SELECT o AS ord, p_ids[o] AS id FROM unnest(fast) AS o
        ), pr AS (
            SELECT fx.ord, fx.id, d.endpoint_id,
                   coalesce((SELECT max(a.n) FROM webhook_attempts a WHERE a.delivery_id = fx.id), 0) + 1 AS n
              FROM fx JOIN webhook_deliveries d ON d.id = fx.id
        ), logged AS (
            INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response)
            SELECT pr.id, pr.n, p_started_at[pr.ord], p_status_codes[pr.ord], p_latency_ms[pr.ord],
                   p_errors[pr.ord], p_responses[pr.ord]
              FROM pr
        ), settled AS (
            UPDATE webhook_deliveries d SET status = 'delivered', attempts = pr.n, next_attempt_at = NULL,
                   lease_owner = NULL, lease_until = NULL, updated_at = ts
              FROM pr WHERE d.id = pr.id AND d.lease_owner = p_owner
        ), healthy AS (
            UPDATE webhook_endpoints e SET failing_since = NULL
             WHERE e.id IN (SELECT pr.endpoint_id FROM pr) AND e.failing_since IS NOT NULL
        )
        SELECT fx.ord, CASE WHEN pr.id IS NULL THEN 'dropped' ELSE 'delivered' END,  -- dropped: endpoint deleted
               NULL::DOUBLE PRECISION, FALSE
          FROM fx LEFT JOIN pr ON pr.ord = fx.ord;
    END IF;

    -- Everything else (failures, retries, a delivery twice in one batch) one by one, in order.
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        CONTINUE WHEN i = ANY(fast);
        SELECT * INTO f FROM herald_webhook_finish(
            p_ids[i], p_targets[i], p_job_ids[i], p_owner, p_started_at[i], p_status_codes[i], p_latency_ms[i],
            p_errors[i], p_responses[i], p_ok[i], p_plans[i], p_delays_s[i], p_gone[i], p_disable_after);
        o_ord := i;
        o_status := f.o_status;
        o_next_attempt_at := f.o_next_attempt_at;
        o_endpoint_disabled := f.o_endpoint_disabled;
        RETURN NEXT;
    END LOOP;
END $$;

-- ===== webhooks-3-claim-by-target
-- PostgreSQL migration 9: the claim read per target.
-- The names in braces are filled in when it is applied (herald/storage/postgres/webhooks.py).

-- The claim of webhooks migration 3, replacing 0007's: the same rules, read per target. The
-- targets with pending deliveries come from a loose index scan (one probe per target), and
-- each target's oldest claimable deliveries from its own range of a partial index, at most
-- the slots it has left (LATERAL ... LIMIT). The window over every pending row, run on every
-- claim, grew with the backlog and was the claim's whole cost (bench/RESULTS.md, issue 14).
CREATE INDEX webhook_deliveries_pending_by_target ON webhook_deliveries (target, next_attempt_at, seq)
    WHERE status = 'pending';

-- A new result column (the job's trace context), so dropped and created again.
DROP FUNCTION herald_webhook_claim(TEXT, DOUBLE PRECISION, INTEGER, INTEGER, TEXT[], INTEGER[]);

CREATE FUNCTION herald_webhook_claim(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[],
                 job_traceparent TEXT, job_tracestate TEXT)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION := extract(epoch from clock_timestamp())::double precision;
    ids TEXT[];
BEGIN
    -- Candidates: per target, due, unleased, endpoint enabled, its message there, nothing
    -- whose older version of the same job is pending for the same target, oldest first, as
    -- many as the slots the target has left in this notifier (p_busy_*: what it has in
    -- flight); then the oldest of them all, locked SKIP LOCKED (rows another notifier holds
    -- are passed over), up to p_limit.
    SELECT coalesce(array_agg(locked.id), '{}') INTO ids FROM (
        SELECT d.id
          FROM webhook_deliveries d
          JOIN (
            WITH RECURSIVE targets(target) AS (
                SELECT (SELECT min(w.target) FROM webhook_deliveries w WHERE w.status = 'pending')
                UNION ALL
                SELECT (SELECT min(w.target) FROM webhook_deliveries w
                         WHERE w.status = 'pending' AND w.target > t.target)
                  FROM targets t WHERE t.target IS NOT NULL
            )
            SELECT cand.id, cand.next_attempt_at, cand.seq
              FROM targets t
              LEFT JOIN unnest(p_busy_targets, p_busy_counts) AS b(target, n) ON b.target = t.target
             CROSS JOIN LATERAL (
                SELECT c.id, c.next_attempt_at, c.seq
                  FROM webhook_deliveries c
                  LEFT JOIN webhook_endpoints e ON e.id = c.endpoint_id
                 WHERE c.target = t.target AND c.status = 'pending' AND c.next_attempt_at <= ts
                   AND (c.lease_until IS NULL OR c.lease_until <= ts)
                   AND (c.endpoint_id IS NULL OR e.status = 'enabled')
                   AND EXISTS (SELECT 1 FROM webhook_messages m WHERE m.event_id = c.event_id)
                   -- no older version of the job pending for the target: written as a
                   -- correlated sub-select so that it is one probe of (target, job_id) per
                   -- candidate whatever the statistics say (a fresh table's planner chose a
                   -- scan of the target's whole backlog per candidate for a NOT EXISTS)
                   AND (SELECT min(older.version) FROM webhook_deliveries older
                         WHERE older.target = c.target AND older.job_id = c.job_id
                           AND older.status = 'pending') = c.version
                 ORDER BY c.next_attempt_at, c.seq
                 LIMIT greatest(p_per_target - coalesce(b.n, 0), 0)
             ) cand
             WHERE t.target IS NOT NULL
          ) c ON c.id = d.id
         WHERE d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
         ORDER BY c.next_attempt_at, c.seq
         LIMIT p_limit
           FOR UPDATE OF d SKIP LOCKED
    ) locked;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;

    -- A new snapshot: an older version committed by a fan-out since the candidates were
    -- read holds its newer one back (fan-out locked the newer row while deciding, so it
    -- either finished before our lock or will see our lease and supersede itself).
    RETURN QUERY
    WITH leased AS (
        UPDATE webhook_deliveries d SET lease_owner = p_owner, lease_until = ts + p_lease_s
         WHERE d.id = ANY(ids)
           AND (SELECT min(older.version) FROM webhook_deliveries older
                 WHERE older.target = d.target AND older.job_id = d.job_id
                   AND older.status = 'pending') = d.version
        RETURNING d
    )
    SELECT l.d, coalesce(e.url, (l.d).url), m.body, k.algorithms, k.secrets, k.public_keys,
           j.traceparent, j.tracestate
      FROM leased l
      JOIN webhook_messages m ON m.event_id = (l.d).event_id
      LEFT JOIN webhook_endpoints e ON e.id = (l.d).endpoint_id
      LEFT JOIN jobs j ON j.id = (l.d).job_id  -- the trace context, with the claim: no second round trip
     CROSS JOIN LATERAL (
        -- the keys that sign now: the current one first, then any in their overlap
        SELECT array_agg(wk.algorithm ORDER BY wk.created_at DESC) AS algorithms,
               array_agg(wk.secret ORDER BY wk.created_at DESC) AS secrets,
               array_agg(wk.public_key ORDER BY wk.created_at DESC) AS public_keys
          FROM webhook_keys wk
         WHERE wk.owner = coalesce((l.d).endpoint_id, 'callback:' || (l.d).tenant)
           AND (wk.retire_at IS NULL OR wk.retire_at > ts)
     ) k
     ORDER BY (l.d).next_attempt_at, (l.d).seq;
END $$;

-- ===== webhooks-4-fair-claim
-- PostgreSQL migration 10: the claim fair among tenants.
-- The names in braces are filled in when it is applied (herald/storage/postgres/webhooks.py).

-- The claim fair among tenants, and within a tenant among its targets (SPEC §13; "migration
-- 3" in the comments is 0009, from when each store numbered its own). The candidates are
-- read as in migration 3 (per target, at most the slots the
-- target has left in this notifier), minus the targets the notifier holds back (p_held: at
-- their cap per origin, or paced by its circuit breaker). Then, instead of "oldest first
-- over everything" (which let a tenant's backlog take every slot before another tenant's
-- due delivery), each tenant's candidates are ranked round robin over its targets and cut
-- at the slots the tenant has left here (p_per_tenant minus p_busy_tenants' counts), and
-- the free slots go to the tenant with the fewest in flight first (water-filling: slot k
-- of a tenant with n in flight sorts at n + k), oldest first among equals.
DROP FUNCTION herald_webhook_claim(TEXT, DOUBLE PRECISION, INTEGER, INTEGER, TEXT[], INTEGER[]);

CREATE FUNCTION herald_webhook_claim(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[],
    p_per_tenant INTEGER, p_busy_tenants TEXT[], p_tenant_counts INTEGER[], p_held TEXT[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[],
                 job_traceparent TEXT, job_tracestate TEXT)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION := extract(epoch from clock_timestamp())::double precision;
    ids TEXT[];
BEGIN
    SELECT coalesce(array_agg(locked.id), '{}') INTO ids FROM (
        SELECT d.id
          FROM webhook_deliveries d
          JOIN (
            WITH RECURSIVE targets(target) AS (
                SELECT (SELECT min(w.target) FROM webhook_deliveries w WHERE w.status = 'pending')
                UNION ALL
                SELECT (SELECT min(w.target) FROM webhook_deliveries w
                         WHERE w.status = 'pending' AND w.target > t.target)
                  FROM targets t WHERE t.target IS NOT NULL
            ), per_target AS (
                SELECT cand.id, cand.tenant, cand.next_attempt_at, cand.seq,
                       row_number() OVER (PARTITION BY t.target ORDER BY cand.next_attempt_at, cand.seq) AS target_rank
                  FROM targets t
                  LEFT JOIN unnest(p_busy_targets, p_busy_counts) AS b(target, n) ON b.target = t.target
                 CROSS JOIN LATERAL (
                    SELECT c.id, c.tenant, c.next_attempt_at, c.seq
                      FROM webhook_deliveries c
                      LEFT JOIN webhook_endpoints e ON e.id = c.endpoint_id
                     WHERE c.target = t.target AND c.status = 'pending' AND c.next_attempt_at <= ts
                       AND (c.lease_until IS NULL OR c.lease_until <= ts)
                       AND (c.endpoint_id IS NULL OR e.status = 'enabled')
                       AND EXISTS (SELECT 1 FROM webhook_messages m WHERE m.event_id = c.event_id)
                       -- one probe of (target, job_id) per candidate (see migration 3)
                       AND (SELECT min(older.version) FROM webhook_deliveries older
                             WHERE older.target = c.target AND older.job_id = c.job_id
                               AND older.status = 'pending') = c.version
                     ORDER BY c.next_attempt_at, c.seq
                     LIMIT greatest(p_per_target - coalesce(b.n, 0), 0)
                 ) cand
                 WHERE t.target IS NOT NULL AND NOT (t.target = ANY(p_held))
            ), per_tenant AS (
                SELECT pt.id, pt.next_attempt_at, pt.seq, coalesce(bt.n, 0) AS busy,
                       row_number() OVER (PARTITION BY pt.tenant
                                          ORDER BY pt.target_rank, pt.next_attempt_at, pt.seq) AS tenant_rank
                  FROM per_target pt
                  LEFT JOIN unnest(p_busy_tenants, p_tenant_counts) AS bt(tenant, n) ON bt.tenant = pt.tenant
            )
            SELECT pt.id, pt.next_attempt_at, pt.seq, pt.busy + pt.tenant_rank AS share
              FROM per_tenant pt
             WHERE p_per_tenant <= 0 OR pt.busy + pt.tenant_rank <= p_per_tenant
          ) c ON c.id = d.id
         WHERE d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
         ORDER BY c.share, c.next_attempt_at, c.seq
         LIMIT p_limit
           FOR UPDATE OF d SKIP LOCKED
    ) locked;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;

    -- A new snapshot: an older version committed by a fan-out since the candidates were
    -- read holds its newer one back (see migration 3).
    RETURN QUERY
    WITH leased AS (
        UPDATE webhook_deliveries d SET lease_owner = p_owner, lease_until = ts + p_lease_s
         WHERE d.id = ANY(ids)
           AND (SELECT min(older.version) FROM webhook_deliveries older
                 WHERE older.target = d.target AND older.job_id = d.job_id
                   AND older.status = 'pending') = d.version
        RETURNING d
    )
    SELECT l.d, coalesce(e.url, (l.d).url), m.body, k.algorithms, k.secrets, k.public_keys,
           j.traceparent, j.tracestate
      FROM leased l
      JOIN webhook_messages m ON m.event_id = (l.d).event_id
      LEFT JOIN webhook_endpoints e ON e.id = (l.d).endpoint_id
      LEFT JOIN jobs j ON j.id = (l.d).job_id
     CROSS JOIN LATERAL (
        SELECT array_agg(wk.algorithm ORDER BY wk.created_at DESC) AS algorithms,
               array_agg(wk.secret ORDER BY wk.created_at DESC) AS secrets,
               array_agg(wk.public_key ORDER BY wk.created_at DESC) AS public_keys
          FROM webhook_keys wk
         WHERE wk.owner = coalesce((l.d).endpoint_id, 'callback:' || (l.d).tenant)
           AND (wk.retire_at IS NULL OR wk.retire_at > ts)
     ) k
     ORDER BY array_position(ids, (l.d).id);
END $$;

-- ===== webhooks-5-claim-skips-capped-tenants
-- PostgreSQL migration 12: the claim passes over a tenant at its cap before reading.
-- The names in braces are filled in when it is applied (herald/storage/postgres/webhooks.py).

-- Migration 10's claim read every pending target's candidates, then dropped those of tenants
-- with no slot left here (p_per_tenant). A tenant at its cap behind many targets (the noisy
-- bench: 40 hanging callback receivers) was read in full on every claim for nothing, and its
-- older deliveries to a target another tenant shares took that target's room. Now the claim
-- walks tenants first (a loose scan of the index below: one probe per tenant), leaves out
-- those at their cap, then each remaining tenant's targets and their candidates (at most the
-- target's room each; a target several tenants share keeps its room for the oldest over
-- them). The same rules as SQLite's claim (herald/storage/sqlite/queue.py), same signature.
CREATE INDEX webhook_deliveries_pending_by_tenant ON webhook_deliveries (tenant, target, next_attempt_at, seq)
    WHERE status = 'pending';

CREATE OR REPLACE FUNCTION herald_webhook_claim(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[],
    p_per_tenant INTEGER, p_busy_tenants TEXT[], p_tenant_counts INTEGER[], p_held TEXT[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[],
                 job_traceparent TEXT, job_tracestate TEXT)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION := extract(epoch from clock_timestamp())::double precision;
    ids TEXT[];
BEGIN
    SELECT coalesce(array_agg(locked.id), '{}') INTO ids FROM (
        SELECT d.id
          FROM webhook_deliveries d
          JOIN (
            WITH RECURSIVE pending_tenants(tenant) AS (
                SELECT (SELECT min(w.tenant) FROM webhook_deliveries w WHERE w.status = 'pending')
                UNION ALL
                SELECT (SELECT min(w.tenant) FROM webhook_deliveries w
                         WHERE w.status = 'pending' AND w.tenant > t.tenant)
                  FROM pending_tenants t WHERE t.tenant IS NOT NULL
            ), open_tenants AS (
                SELECT t.tenant FROM pending_tenants t
                 WHERE t.tenant IS NOT NULL
                   AND NOT EXISTS (SELECT 1 FROM unnest(p_busy_tenants, p_tenant_counts) AS bt(tenant, n)
                                    WHERE p_per_tenant > 0 AND bt.tenant = t.tenant AND bt.n >= p_per_tenant)
            ), targets(tenant, target) AS (
                SELECT o.tenant, (SELECT min(w.target) FROM webhook_deliveries w
                                   WHERE w.status = 'pending' AND w.tenant = o.tenant)
                  FROM open_tenants o
                UNION ALL
                SELECT t.tenant, (SELECT min(w.target) FROM webhook_deliveries w
                                   WHERE w.status = 'pending' AND w.tenant = t.tenant AND w.target > t.target)
                  FROM targets t WHERE t.target IS NOT NULL
            ), candidates AS (
                SELECT cand.id, cand.tenant, cand.next_attempt_at, cand.seq,
                       greatest(p_per_target - coalesce(b.n, 0), 0) AS room,
                       row_number() OVER (PARTITION BY t.target ORDER BY cand.next_attempt_at, cand.seq) AS target_rank
                  FROM targets t
                  LEFT JOIN unnest(p_busy_targets, p_busy_counts) AS b(target, n) ON b.target = t.target
                 CROSS JOIN LATERAL (
                    SELECT c.id, c.tenant, c.next_attempt_at, c.seq
                      FROM webhook_deliveries c
                      LEFT JOIN webhook_endpoints e ON e.id = c.endpoint_id
                     WHERE c.tenant = t.tenant AND c.target = t.target AND c.status = 'pending'
                       AND c.next_attempt_at <= ts
                       AND (c.lease_until IS NULL OR c.lease_until <= ts)
                       AND (c.endpoint_id IS NULL OR e.status = 'enabled')
                       AND EXISTS (SELECT 1 FROM webhook_messages m WHERE m.event_id = c.event_id)
                       -- one probe of (target, job_id) per candidate (see migration 3)
                       AND (SELECT min(older.version) FROM webhook_deliveries older
                             WHERE older.target = c.target AND older.job_id = c.job_id
                               AND older.status = 'pending') = c.version
                     ORDER BY c.next_attempt_at, c.seq
                     LIMIT greatest(p_per_target - coalesce(b.n, 0), 0)
                 ) cand
                 WHERE t.target IS NOT NULL AND NOT (t.target = ANY(p_held))
            ), per_target AS (
                -- a target several tenants send to: its room goes to the oldest over them
                SELECT r.id, r.tenant, r.next_attempt_at, r.seq, r.target_rank FROM candidates r WHERE r.target_rank <= r.room
            ), per_tenant AS (
                SELECT pt.id, pt.next_attempt_at, pt.seq, coalesce(bt.n, 0) AS busy,
                       row_number() OVER (PARTITION BY pt.tenant
                                          ORDER BY pt.target_rank, pt.next_attempt_at, pt.seq) AS tenant_rank
                  FROM per_target pt
                  LEFT JOIN unnest(p_busy_tenants, p_tenant_counts) AS bt(tenant, n) ON bt.tenant = pt.tenant
            )
            SELECT pt.id, pt.next_attempt_at, pt.seq, pt.busy + pt.tenant_rank AS share
              FROM per_tenant pt
             WHERE p_per_tenant <= 0 OR pt.busy + pt.tenant_rank <= p_per_tenant
          ) c ON c.id = d.id
         WHERE d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
         ORDER BY c.share, c.next_attempt_at, c.seq
         LIMIT p_limit
           FOR UPDATE OF d SKIP LOCKED
    ) locked;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;

    -- A new snapshot: an older version committed by a fan-out since the candidates were
    -- read holds its newer one back (see migration 3).
    RETURN QUERY
    WITH leased AS (
        UPDATE webhook_deliveries d SET lease_owner = p_owner, lease_until = ts + p_lease_s
         WHERE d.id = ANY(ids)
           AND (SELECT min(older.version) FROM webhook_deliveries older
                 WHERE older.target = d.target AND older.job_id = d.job_id
                   AND older.status = 'pending') = d.version
        RETURNING d
    )
    SELECT l.d, coalesce(e.url, (l.d).url), m.body, k.algorithms, k.secrets, k.public_keys,
           j.traceparent, j.tracestate
      FROM leased l
      JOIN webhook_messages m ON m.event_id = (l.d).event_id
      LEFT JOIN webhook_endpoints e ON e.id = (l.d).endpoint_id
      LEFT JOIN jobs j ON j.id = (l.d).job_id
     CROSS JOIN LATERAL (
        SELECT array_agg(wk.algorithm ORDER BY wk.created_at DESC) AS algorithms,
               array_agg(wk.secret ORDER BY wk.created_at DESC) AS secrets,
               array_agg(wk.public_key ORDER BY wk.created_at DESC) AS public_keys
          FROM webhook_keys wk
         WHERE wk.owner = coalesce((l.d).endpoint_id, 'callback:' || (l.d).tenant)
           AND (wk.retire_at IS NULL OR wk.retire_at > ts)
     ) k
     ORDER BY array_position(ids, (l.d).id);
END $$;

-- ===== tenants-1
CREATE TABLE IF NOT EXISTS herald_tenants (
    id TEXT PRIMARY KEY,
    created_at DOUBLE PRECISION NOT NULL,
    disabled BOOLEAN NOT NULL DEFAULT false,
    source TEXT NOT NULL DEFAULT 'api',
    limits JSONB NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS herald_api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    scopes TEXT NOT NULL,
    digest BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION,
    last_used_at DOUBLE PRECISION,
    revoked_at DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS herald_api_keys_tenant ON herald_api_keys (tenant, created_at);
CREATE TABLE IF NOT EXISTS herald_audit (
    seq BIGSERIAL PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL,
    action TEXT NOT NULL,
    tenant TEXT,
    key_id TEXT,
    detail JSONB NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS herald_directory (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL
);
INSERT INTO herald_directory (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;

CREATE TABLE herald_migrations (name TEXT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL);
INSERT INTO herald_migrations (name, applied_at) VALUES ('jobs-1', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('jobs-trace-context', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('jobs-queued-by-kind', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('outbox-origin', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('jobs-tenant-fair-share', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('jobs-events-numbered-after-commit', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('webhooks-1-tables', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('webhooks-1-functions', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('webhooks-2-finish-many', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('webhooks-3-claim-by-target', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('webhooks-4-fair-claim', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('webhooks-5-claim-skips-capped-tenants', extract(epoch from clock_timestamp()));
INSERT INTO herald_migrations (name, applied_at) VALUES ('tenants-1', extract(epoch from clock_timestamp()));
