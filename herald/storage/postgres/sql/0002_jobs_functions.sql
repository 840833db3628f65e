-- PostgreSQL migration 2: the job store's writes, each one statement from the client.
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py):
-- now is the server's clock in Unix seconds.
--
-- A database made before trace contexts were kept (its migration 1 had neither the columns
-- nor these functions' trace parameters) gets the columns, and loses the functions of the
-- old signatures; on any other database the first four statements do nothing.

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
            convert_to('{"seq":' || v_seq || ',', 'UTF8') || p_event_tail, {now}, p_traceparent, p_tracestate);
    IF p_work_subject IS NOT NULL THEN
        INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate)
        VALUES (p_work_subject, p_work_msg_id, p_work_payload, {now}, p_traceparent, p_tracestate);
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
        INSERT INTO rate_buckets (tenant, tokens, at) VALUES (p_tenant, p_burst, {now})
        ON CONFLICT (tenant) DO NOTHING;
        SELECT b.tokens, b.at INTO v_tokens, v_at FROM rate_buckets b WHERE b.tenant = p_tenant FOR UPDATE;
        v_now := {now};  -- read under the lock: the bucket's times only move forward
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
