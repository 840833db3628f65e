-- PostgreSQL functions, the job store's writes, each one statement from the client.
-- A repeatable definition (herald/storage/migrations.py): applied, after the numbered
-- migrations, to every database whose record of this file differs; edit it in place.
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).

CREATE OR REPLACE FUNCTION herald_append_event(
    p_tenant TEXT, p_job_id TEXT, p_kind TEXT, p_version INTEGER, p_type TEXT, p_at DOUBLE PRECISION,
    p_data BYTEA, p_event_subject TEXT, p_event_tail BYTEA,  -- subject: its head, no audience
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA,
    p_traceparent TEXT, p_tracestate TEXT
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    v_id BIGINT;
    v_notify BOOLEAN;
BEGIN
    -- No tenant-wide lock: the event is numbered after commit (herald_number_events).
    INSERT INTO events (tenant, job_id, kind, version, type, at, data)
    VALUES (p_tenant, p_job_id, p_kind, p_version, p_type, p_at, p_data)
    RETURNING id INTO v_id;
    -- The subject's audience (herald.constants.event_subject): 'notify' when some webhook
    -- target wants the event as it commits, by herald.deliveries.some_target_wants' rule (a
    -- matching enabled endpoint; the job's callback URL, for every type but progress), else
    -- 'quiet', which the notifier's consumer never receives.
    v_notify := EXISTS (SELECT 1 FROM webhook_endpoints e
                         WHERE e.tenant = p_tenant AND e.status = 'enabled' AND p_type = ANY(e.event_types)
                           AND (e.kinds IS NULL OR p_kind = ANY(e.kinds)))
             OR (p_type <> 'job.progress' AND EXISTS (SELECT 1 FROM jobs j WHERE j.id = p_job_id
                                                       AND j.callback_url IS NOT NULL AND j.callback_url <> ''));
    -- The JobEvent's JSON without its {"seq":N, head (the client sent the rest); the job's
    -- trace context rides along: the relay sends it as the message's headers.
    INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate, event_id)
    VALUES (p_event_subject || CASE WHEN v_notify THEN '.{notify}' ELSE '.{quiet}' END,
            'ev.' || p_job_id || '.' || p_version, p_event_tail, {now},
            p_traceparent, p_tracestate, v_id);
    IF p_work_subject IS NOT NULL THEN
        INSERT INTO outbox (subject, msg_id, payload, created_at, traceparent, tracestate)
        VALUES (p_work_subject, p_work_msg_id, p_work_payload, {now}, p_traceparent, p_tracestate);
    END IF;
    RETURN 0;  -- committed, not numbered yet
END
$fn$;

CREATE OR REPLACE FUNCTION herald_accept(
    p_id TEXT, p_tenant TEXT, p_kind TEXT, p_collection TEXT, p_params BYTEA, p_callback_url TEXT,
    p_ts DOUBLE PRECISION, p_deadline_s DOUBLE PRECISION,
    p_key TEXT, p_fingerprint TEXT, p_key_ttl_s DOUBLE PRECISION,
    p_rate DOUBLE PRECISION, p_burst DOUBLE PRECISION,
    p_event_subject TEXT, p_event_data BYTEA, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA,
    p_traceparent TEXT, p_tracestate TEXT
) RETURNS herald_accepted LANGUAGE plpgsql AS $fn$
DECLARE
    v_out herald_accepted;  -- a named type, not OUT parameters: accepts combine (migration 20)
    v_job jobs;
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
            v_out.outcome := 'limited';
            v_out.wait_s := CASE WHEN p_rate > 0 THEN (1 - v_tokens) / p_rate ELSE 'Infinity'::float8 END;
            RETURN v_out;
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
                v_out.outcome := 'mismatch';  -- nothing written: the claim conflicted, the token is unspent
                RETURN v_out;
            END IF;
            SELECT * INTO v_job FROM jobs j WHERE j.id = v_key.job_id;
            IF FOUND THEN
                IF p_rate IS NOT NULL THEN  -- replays count against the budget (SPEC 10)
                    UPDATE rate_buckets SET tokens = v_tokens - 1, at = v_now WHERE tenant = p_tenant;
                END IF;
                v_out.outcome := 'replayed';
                v_out.job := v_job;
                RETURN v_out;
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
    RETURNING * INTO v_job;
    v_out.job := v_job;
    v_out.event_seq := herald_append_event(p_tenant, p_id, p_kind, 1, 'job.queued', p_ts, p_event_data,
                                     p_event_subject, p_event_tail, p_work_subject, p_work_msg_id, p_work_payload,
                                     p_traceparent, p_tracestate);
    v_out.outcome := 'accepted';
    RETURN v_out;
END
$fn$;

CREATE OR REPLACE FUNCTION herald_transition(
    p_id TEXT, p_seen_version INTEGER, p_seen_updated_at DOUBLE PRECISION,
    p_state TEXT, p_progress INTEGER, p_attempt INTEGER, p_cancel_requested BOOLEAN,
    p_heartbeat_at DOUBLE PRECISION, p_error BYTEA, p_result_path TEXT, p_media_type TEXT, p_result_body BYTEA,
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
        result_body = p_result_body,
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

-- SPEC §13's capped claim (Change.max_running): herald_transition under the tenant's cap. A
-- capped claim locks the job row, then the tenant's counter row (the order every write takes
-- them in), counts the tenant's running jobs and only then transitions: two capped claims of
-- one tenant are serialised, so both cannot take its last slot. -1: the tenant is at its cap.
-- The tenant_seq row appears with the tenant's first numbering pass (migration 13), so the
-- claim makes it if it is not there yet (a lock on a row that does not exist would be no lock).
CREATE OR REPLACE FUNCTION herald_claim_capped(
    p_max_running INTEGER,
    p_id TEXT, p_seen_version INTEGER, p_seen_updated_at DOUBLE PRECISION,
    p_state TEXT, p_progress INTEGER, p_attempt INTEGER, p_cancel_requested BOOLEAN,
    p_heartbeat_at DOUBLE PRECISION, p_error BYTEA, p_result_path TEXT, p_media_type TEXT, p_result_body BYTEA,
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
                             p_cancel_requested, p_heartbeat_at, p_error, p_result_path, p_media_type, p_result_body,
                             p_finished_at, p_expires_at, p_updated_at, p_event_type, p_event_subject,
                             p_event_data, p_event_tail, p_work_subject, p_work_msg_id, p_work_payload);
END
$fn$;
